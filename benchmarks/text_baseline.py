"""The Transformer (`--model=transformer`) against a bag-of-words baseline on
the clothing reviews (`--dataset=clothing_reviews`).

Not a test: it prints figures and writes JSON. Both read the same converted
TFRecords (the same vocabulary, the same held-out 20%):

* baseline: logistic regression on the multi-hot bag of the review's tokens
  (`keras.layers.CategoryEncoding(output_mode="multi_hot")` then one
  `Dense` sigmoid unit), Adam, plain Keras `fit`, `--baseline_epochs`;
* transformer: `python -m tfdist.train --dataset=clothing_reviews` (the
  data set's recommendations: the Transformer, AdamW, batches of 64) with
  a cosine schedule after warmup, for each `--strategies` entry
  (`one_device`; `mirrored_zero2`: 2 logical CPU devices, ZeRO stage 2),
  in a fresh process each.

It reports each run's held-out accuracy and AUC, and the majority-class
accuracy (every review "recommended").

Usage:
  python benchmarks/text_baseline.py --out=benchmarks/results/text_baseline.json
"""

import datetime
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", "", "Converted data sets (default: a "
                    "temporary folder).")
flags.DEFINE_integer("baseline_epochs", 10, "Epochs of the baseline (it has "
                     "converged by 10: 20 gave the same accuracy).")
flags.DEFINE_integer("train_epochs", 3, "Epochs of each Transformer run.")
flags.DEFINE_list("strategies", ["one_device", "mirrored_zero2"],
                  "Transformer runs: one_device, mirrored_zero2.")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")

_STRATEGY_FLAGS = {
    "one_device": ["--distribution_strategy=one_device"],
    "mirrored_zero2": ["--distribution_strategy=mirrored",
                       "--num_cpu_devices=2", "--zero_stage=2"],
}
_FINAL = re.compile(r"Final eval: loss ([0-9.]+), accuracy ([0-9.]+), "
                    r"AUC ([0-9.]+) \((\d+) examples\)")


def _baseline(data_dir: str, epochs: int) -> dict:
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
  folder = os.path.join(data_dir, "clothing_reviews")
  with open(os.path.join(folder, "dataset_info.json")) as f:
    info = json.load(f)
  vocab = info["vocabulary_size"]

  def split(name, shuffle):
    files = sorted(glob.glob(os.path.join(folder, f"{name}-*.tfrecord.gz")))
    ds = tf.data.TFRecordDataset(files, compression_type="GZIP").map(
        clothing_reviews.parse_example)
    if shuffle:
      ds = ds.shuffle(20_000, seed=0)
    return ds.batch(64)

  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((clothing_reviews.SEQUENCE_LENGTH,), dtype="int64"),
      keras.layers.CategoryEncoding(num_tokens=vocab, output_mode="multi_hot"),
      keras.layers.Dropout(0.5),
      keras.layers.Dense(1, activation="sigmoid")])
  model.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss="binary_crossentropy",
                metrics=["accuracy", keras.metrics.AUC(name="auc")])
  model.fit(split("train", True), epochs=epochs, verbose=2)
  loss, accuracy, auc = model.evaluate(split("test", False), verbose=0)
  return {"loss": loss, "accuracy": accuracy, "auc": auc,
          "positive_fraction": info["splits"]["test"]["positive_fraction"],
          "examples": info["splits"]["test"]["num_examples"]}


def _transformer(data_dir: str, strategy: str, epochs: float) -> dict:
  model_dir = tempfile.mkdtemp(prefix=f"text_{strategy}_")
  args = [sys.executable, "-m", "tfdist.train", "--dataset=clothing_reviews",
          f"--data_dir={data_dir}", f"--model_dir={model_dir}",
          f"--train_epochs={epochs}", "--lr_schedule=cosine",
          "--warmup_epochs=0.5", "--weight_decay=0.01", "--seed=0",
          "--log_steps=100", *_STRATEGY_FLAGS[strategy]]
  started = datetime.datetime.now()
  proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True,
                        timeout=3600, check=False,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
  seconds = (datetime.datetime.now() - started).total_seconds()
  found = _FINAL.search(proc.stdout + proc.stderr)
  if proc.returncode != 0 or not found:
    raise SystemExit(f"{strategy}: exit {proc.returncode}\n"
                     f"{(proc.stdout + proc.stderr)[-3000:]}")
  return {"strategy": strategy, "flags": args[3:], "seconds": seconds,
          "loss": float(found.group(1)), "accuracy": float(found.group(2)),
          "auc": float(found.group(3)), "examples": int(found.group(4))}


def main(argv):
  del argv
  data_dir = FLAGS.data_dir or tempfile.mkdtemp(prefix="text_data_")
  from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
  clothing_reviews.prepare(data_dir, "")
  load = os.getloadavg()
  baseline = _baseline(data_dir, FLAGS.baseline_epochs)
  print(f"bag of words: accuracy {baseline['accuracy']:.4f}, AUC "
        f"{baseline['auc']:.4f} (majority class "
        f"{baseline['positive_fraction']:.4f}) on {baseline['examples']}")
  runs = []
  for strategy in FLAGS.strategies:
    run = _transformer(data_dir, strategy, FLAGS.train_epochs)
    runs.append(run)
    print(f"transformer {strategy}: accuracy {run['accuracy']:.4f}, AUC "
          f"{run['auc']:.4f} ({run['seconds']:.0f} s)")
  result = {"date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/text_baseline.py",
                                 *sys.argv[1:]]),
            "load_average_at_start": load, "baseline": baseline,
            "transformer": runs}
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
