"""The `flashformer` command: `commands.py` holds the table of commands and the entry point,
one module here per command (train, finetune, generate, chat, embed, eval, serve; `bench`,
`cost` and `viz` live in their rooms), `arguments.py` what several of them share."""

from flashformer.cli.commands import main

__all__ = ["main"]
