"""This project's own models.

A package named `models` at a project's root used to shadow tfdist's
built-in models when the project ran `python -m tfdist.train` from there;
tfdist now imports its own as `tfdist.models`, so `--model=models.tagger:...`
names this package.
"""
