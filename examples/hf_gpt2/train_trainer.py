"""A Hugging Face GPT-2 through the Hugging Face ``Trainer`` with ``--deepspeed`` (ZeRO-3, ds_config_trainer.json),
with cpsr_ds; train_trainer_deepspeed.py is the same script without it (docs/how-to/hf-trainer.md shows the diff).

    deepspeed --num_gpus 2 examples/hf_gpt2/train_trainer.py \
        --deepspeed examples/hf_gpt2/ds_config_trainer.json --output_dir runs/hf_trainer --max_steps 20
"""

from transformers import HfArgumentParser, TrainingArguments

from cpsr_ds.integration.huggingface import CPSRTrainer as Trainer
from model import TokenSequences, gpt2


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    trainer = Trainer(model=gpt2(), args=args, train_dataset=TokenSequences(1024))
    trainer.train()
    trainer.save_model()
    trainer.model_wrapped.destroy()  # the engine's end: cpsr_ds's pending checkpoints committed


if __name__ == "__main__":
    main()
