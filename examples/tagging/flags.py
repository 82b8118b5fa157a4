"""This project's own flags (for make_data.py).

A module named `flags` at a project's root used to shadow tfdist's own flag
definitions when the project ran `python -m tfdist.train` from there;
tfdist now imports its flags as `tfdist.flags`, so this file is harmless.
"""

from absl import flags

flags.DEFINE_string("out_dir", "data", "Where the TFRecord files go.")
flags.DEFINE_integer("num_train", 4096, "Training examples.")
flags.DEFINE_integer("num_eval", 1024, "Evaluation examples.")
flags.DEFINE_integer("num_shards", 4, "Training files (evaluation: half).")
flags.DEFINE_integer("seed", 0, "Random seed of the generated data.")

FLAGS = flags.FLAGS
