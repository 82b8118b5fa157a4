"""What a Keras loss says, tfdist does on two MultiWorkerMirrored workers.

The rows of the fit-contract table that tests/loss_semantics_testlib.py's
cases measure: a `lambda` returning one value per batch together with
`model.losses` in evaluation and `compile(jit_compile=True)` (one model),
`reduction="sum"`, `reduction=None`: each case on a local cluster of two
workers (one replica each), against `Model.fit` on one device (run by the
chief after its `tfdist.fit`, outside any strategy's scope). One cluster
run per case (a process builds one MultiWorkerMirroredStrategy).
"""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from tests import loss_semantics_testlib as lib
from tests import testutil


class TwoWorkersTest(lib.Checks, parameterized.TestCase):
  """Two MultiWorkerMirrored workers (one replica each; a local cluster,
  `tfdist.launch --module=tests.loss_semantics_testlib`) against `Model.fit`
  on one device (in the chief): one cluster run per case of
  `MULTI_WORKER_CASES` (the `JIT_COMPILED` one also checks the warning)."""

  @parameterized.named_parameters(
      (case, case) for case in lib.MULTI_WORKER_CASES)
  def test_two_workers_match_model_fit(self, case):
    from tests import multi_worker_testlib  # pylint: disable=g-import-not-at-top
    out = os.path.join(tempfile.mkdtemp(dir=testutil.scratch_dir()),
                       "result.json")
    status, output = multi_worker_testlib.run_launcher(
        ["--num_workers=2", "--module=tests.loss_semantics_testlib"],
        [out, case], timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": ""})
    self.assertEqual(status, 0, output[-4000:])
    with open(out) as f:
      result = json.load(f)
    run = result["run"]
    # The reference, Model.fit on one device, ran in the chief after its
    # tfdist.fit (this process starts no TensorFlow).
    self.check_run(case, "multi_worker_mirrored", run, result["keras"])
    if case in lib.JIT_COMPILED:
      self.check_jit_warning(run, "multi_worker_mirrored")


if __name__ == "__main__":
  absltest.main()
