"""Data: token sources (synthetic, token files, prepared token directories) and prepare-data.

`prepare.py`, `inputs.py`, `encode.py`, `tokenizer.py`, `tokendir.py` and `cli.py` turn text
into a prepared directory (`chat.py`: conversations through a chat template, with loss masks;
`pieces.py`: long documents encoded in bounded pieces);
`door.py` checks data against a recipe before any process starts; `sources.py` and
`tokens.py` give sample i of a run as a pure function of the seed and i.
May import config and errors; never torch at module level.
"""
