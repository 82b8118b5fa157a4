"""What the start-up framing check of uncompressed TFRecord files costs.

Not a test: it prints figures and writes JSON. The bundled Fashion-MNIST
training shards (`--data_dir`, converted on first use; GZIP) are inflated
into uncompressed TFRecord files (60,000 records, about 51 MB), and each
way of reading them at start is timed, best of `--repeats`, the page cache
warm:

* `tensorflow_reader`: TensorFlow's reader alone (`tf_record_iterator`,
  C++): what the start-up count did before the framing check;
* `count_file`: `tfdist.data.data_checks.count_file` on local files: TensorFlow's
  reader for the count and the CRCs, then a pass reading only the lengths
  for the framing;
* `one_pass_with_library`: `check_framing` with google-crc32c checking
  every CRC in the same pass (what `count_file` does on `gs://`, where a
  second read is a second download);
* `gzip_tensorflow_reader`: the GZIP shards, as tfdist reads them
  (unchanged).

Usage:
  python benchmarks/framing_check.py --out=benchmarks/results/framing_check.json
"""

import glob
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", "", "Where the converted data sets are "
                    "(default: tfdist's, ~/.cache/tfdist/datasets).")
flags.DEFINE_integer("repeats", 3, "Timed passes of each way; the best is "
                     "reported.")
flags.DEFINE_string("out", "", "Write the figures as JSON here.")


def _best(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - start)
  return min(times), result


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import data_checks  # pylint: disable=g-import-not-at-top
  from tfdist.data import fashion_mnist  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import environment  # pylint: disable=g-import-not-at-top
  data_dir = FLAGS.data_dir or environment.read_environment().default_data_dir
  train_glob, _ = fashion_mnist.prepare(data_dir, "")
  shards = sorted(glob.glob(train_glob))
  scratch = tempfile.mkdtemp()
  try:
    plain = []
    for path in shards:
      out = os.path.join(scratch, os.path.basename(path)[:-len(".gz")])
      with gzip.open(path) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
      plain.append(out)
    size = sum(os.path.getsize(p) for p in plain)

    def tensorflow_reader(paths, compression=""):
      options = tf.io.TFRecordOptions(compression_type=compression)
      return sum(sum(1 for _ in tf.compat.v1.io.tf_record_iterator(p, options))
                 for p in paths)

    ways = {"tensorflow_reader": lambda: tensorflow_reader(plain),
            "count_file": lambda: sum(data_checks.count_file(p)
                                      for p in plain),
            "gzip_tensorflow_reader": lambda: tensorflow_reader(shards,
                                                                "GZIP")}
    if data_checks.LIBRARY_CRC32C is not None:
      ways["one_pass_with_library"] = lambda: sum(
          data_checks.check_framing(p, check_data=True) for p in plain)
    figures = {}
    for name, fn in ways.items():
      seconds, records = _best(fn, FLAGS.repeats)
      figures[name] = {"seconds": round(seconds, 3), "records": records}
      print(f"{name:26s} {seconds:6.3f} s  {records} records", flush=True)
    result = {
        "files": len(plain), "bytes": size, "figures": figures,
        "library_crc32c": data_checks.LIBRARY_CRC32C is not None,
        "tensorflow": tf.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print(f"{len(plain)} files, {size / 1e6:.1f} MB; load average "
          f"{os.getloadavg()[0]:.1f}")
    if FLAGS.out:
      os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
      with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
