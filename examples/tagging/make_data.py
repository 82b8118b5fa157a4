"""Writes generated multi-label TFRecords for the tagging example.

Each `tf.train.Example` has

    signal:  float32 [16]  a noisy sensor reading
    channel: int64         which of 8 channels it came from (some records
                           leave it out: feature_spec.json gives a default)
    id:      int64         present in half of the records only (the feature
                           spec leaves it out: tfdist ignores it)
    tags:    float32 [4]   multi-hot labels: tag k is on when a fixed linear
                           function of signal and channel, plus noise, is > 0

Usage: python make_data.py --out_dir=data [--num_train=4096 --num_eval=1024]
"""

import os

from absl import app
import numpy as np
import tensorflow as tf

import flags  # This project's own flags.py.

NUM_TAGS = 4
NUM_CHANNELS = 8
SIGNAL_WIDTH = 16


def _example(signal, channel, tags, example_id):
  feature = {
      "signal": tf.train.Feature(float_list=tf.train.FloatList(
          value=signal.tolist())),
      "tags": tf.train.Feature(float_list=tf.train.FloatList(
          value=tags.tolist())),
  }
  if channel is not None:
    feature["channel"] = tf.train.Feature(int64_list=tf.train.Int64List(
        value=[int(channel)]))
  if example_id is not None:
    feature["id"] = tf.train.Feature(int64_list=tf.train.Int64List(
        value=[int(example_id)]))
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def write_split(out_dir, split, num_examples, num_shards, rng, weights,
                channel_weights, first_id=0):
  """Writes `num_examples` examples into `num_shards` files; returns paths."""
  signal = rng.normal(size=(num_examples, SIGNAL_WIDTH)).astype(np.float32)
  channel = rng.integers(0, NUM_CHANNELS, size=num_examples)
  score = signal @ weights + channel_weights[channel]
  score += rng.normal(scale=0.5, size=score.shape)
  tags = (score > 0).astype(np.float32)
  paths = [os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}"
                        ".tfrecord") for i in range(num_shards)]
  writers = [tf.io.TFRecordWriter(p) for p in paths]
  try:
    for k in range(num_examples):
      writers[k % num_shards].write(_example(
          signal[k], channel[k] if k % 5 else None, tags[k],
          first_id + k if k % 2 else None))
  finally:
    for w in writers:
      w.close()
  return paths


def main(argv):
  del argv
  cfg = flags.FLAGS
  os.makedirs(cfg.out_dir, exist_ok=True)
  rng = np.random.default_rng(cfg.seed)
  weights = rng.normal(size=(SIGNAL_WIDTH, NUM_TAGS)).astype(np.float32)
  channel_weights = rng.normal(size=(NUM_CHANNELS, NUM_TAGS))
  write_split(cfg.out_dir, "train", cfg.num_train, cfg.num_shards, rng,
              weights, channel_weights)
  write_split(cfg.out_dir, "eval", cfg.num_eval, max(cfg.num_shards // 2, 1),
              rng, weights, channel_weights, first_id=cfg.num_train)
  print(f"Wrote {cfg.num_train} training and {cfg.num_eval} evaluation "
        f"examples to {cfg.out_dir}")


if __name__ == "__main__":
  app.run(main)
