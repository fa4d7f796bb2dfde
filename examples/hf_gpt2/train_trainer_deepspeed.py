"""A Hugging Face GPT-2 through the Hugging Face ``Trainer`` with ``--deepspeed`` (ZeRO-3, ds_config_trainer.json),
without cpsr_ds; train_trainer.py is the same script with cpsr_ds (docs/how-to/hf-trainer.md shows the diff).

    deepspeed --num_gpus 2 examples/hf_gpt2/train_trainer_deepspeed.py \
        --deepspeed examples/hf_gpt2/ds_config_trainer.json --output_dir runs/hf_trainer --max_steps 20
"""

from transformers import HfArgumentParser, Trainer, TrainingArguments

from model import TokenSequences, gpt2


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    trainer = Trainer(model=gpt2(), args=args, train_dataset=TokenSequences(1024))
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
