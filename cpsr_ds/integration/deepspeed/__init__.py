"""Every use of DeepSpeed's private API, each checked against DeepSpeed 0.19.8 and naming the source it relies on.

engine.py: the pipeline engine subclass and its instruction map; install.py: the engine class and the
checkpoint-engine factory put in place for ``deepspeed.initialize``; topology.py: a rank's place in the pipeline;
engine_state.py and shard.py: the engine state read and written; load_hooks.py: around ``load_checkpoint``;
adam_steps.py: the fused CPU Adam's bias correction after a restore.
"""
