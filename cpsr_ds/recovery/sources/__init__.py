"""Where recovered state comes from: the retained checkpoints (``checkpoint``) and the predictor
(``prediction``, PB-R)."""



