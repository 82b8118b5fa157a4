"""README.md and docs/: links resolve; each code block runs or says why not.

* Every relative link in README.md and docs/**/*.md names a file or folder
  that exists, and a `#fragment` names a heading of the target page, by
  GitHub's anchor rules (lower case; punctuation other than `-` and `_`
  dropped; spaces become `-`; a repeated heading gets `-1`, `-2`, ...).
  Links to the pages in PENDING are skipped: other branches add them.
* Every fenced code block is preceded, on the line above, by one of
    `<!-- not run: REASON -->`         (REASON says why), or
    `<!-- run: tests/X_test.py NAME -->` (the test that runs it).
  A `run:` block of this file must be one it runs (RUNNERS below); one of
  another test file must be read by that file (its source names NAME and
  the page).
* The blocks this file runs, as written: the README's `tfdist.fit` example
  in a child process (its `model_dir` moved to a scratch folder), and the
  your-model guide's feature spec, parsed by `tfdist.data.feature_spec`. The
  quick start's two commands are checked too: its training command passes
  `--dry_run` in a second child, at the same time (every start-up check, on
  the real Fashion-MNIST files), and its test command is what `.ci/run`
  runs. A third child runs the Kubernetes guide's `tfdist.job_spec` command,
  whose output must be the TFJob the guide shows.
"""

import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
import unicodedata

from absl.testing import absltest

from tests import testutil

# Pages that branches merged after this one add. The lead empties this
# list when they are merged; until then links to them are not checked.
PENDING = (
)

# The checkout itself: under Bazel the runfiles hold only declared files,
# and links may name any file of the repository.
ROOT = testutil.SOURCE_ROOT
# Seconds from the start of the children to the end of the last one (Bazel's
# medium timeout is 600 s); together they use about 36 s of CPU.
_CHILD_DEADLINE = 500

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
_MARKER = re.compile(r"^\s*<!--\s*(not run|run):\s*(.*?)\s*-->\s*$")
# [text](target) and ![alt](target), with an optional "title".
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]"
                   r"\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def doc_files():
  """README.md and every docs/**/*.md, as paths relative to ROOT."""
  paths = ["README.md"] + sorted(
      os.path.relpath(p, ROOT) for p in glob.glob(
          os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
  return paths


def read(path: str) -> str:
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def code_blocks(text: str):
  """The fenced blocks of a Markdown page.

  Returns:
    A list of dicts: `line` (1-based line of the opening fence), `info` (the
    info string, e.g. `python`), `code` (the lines between the fences) and
    `marker` (the line above the fence, stripped), `closed` (False when the
    page ends inside the block).
  """
  lines = text.split("\n")
  blocks, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    indent, fence, info = m.groups()
    j = i + 1
    while j < len(lines):
      close = _FENCE.match(lines[j])
      if (close and close.group(2)[0] == fence[0] and
          len(close.group(2)) >= len(fence) and not close.group(3).strip()):
        break
      j += 1
    body = [line[len(indent):] if line.startswith(indent) else line
            for line in lines[i + 1:j]]
    blocks.append({"line": i + 1, "info": info.strip(),
                   "closed": j < len(lines),
                   "code": "\n".join(body) + "\n",
                   "marker": lines[i - 1].strip() if i else ""})
    i = j + 1
  return blocks


def prose_lines(text: str):
  """(line number, line) outside fenced code blocks."""
  in_fence = None
  for number, line in enumerate(text.split("\n"), 1):
    m = _FENCE.match(line)
    if m and (in_fence is None or (m.group(2)[0] == in_fence[0] and
                                   len(m.group(2)) >= len(in_fence) and
                                   not m.group(3).strip())):
      in_fence = m.group(2) if in_fence is None else None
      continue
    if in_fence is None:
      yield number, line


def github_anchor(heading: str) -> str:
  """The anchor GitHub gives a heading's text (before de-duplication)."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: text
  text = re.sub(r"<[^>]+>", "", text)                         # inline HTML
  text = text.replace("`", "").strip().lower()
  kept = []
  for ch in text:
    category = unicodedata.category(ch)
    if ch in "-_ " or category[0] in "LN":
      kept.append(ch)
    elif category == "Mn":
      kept.append(ch)
  return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set:
  """Every heading anchor of a page, with GitHub's -1, -2 suffixes."""
  seen, result = {}, set()
  for _, line in prose_lines(text):
    m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    base = github_anchor(m.group(2))
    count = seen.get(base, 0)
    seen[base] = count + 1
    result.add(base if count == 0 else f"{base}-{count}")
  return result


def relative_links(text: str):
  """(line number, target) of every relative link outside code."""
  for number, line in prose_lines(text):
    line = re.sub(r"(`+).*?\1", "", line)   # inline code spans
    for m in _LINK.finditer(line):
      target = m.group(1)
      if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:
        continue
      yield number, target


def link_problems(path: str, text: str, anchor_cache: dict) -> list:
  """What is wrong with the relative links of one page (empty: nothing)."""
  problems = []
  anchor_cache.setdefault(path, anchors(text))
  for number, target in relative_links(text):
    file_part, _, fragment = target.partition("#")
    if file_part:
      resolved = os.path.normpath(
          os.path.join(os.path.dirname(path), file_part))
    else:
      resolved = path
    if resolved in PENDING:
      continue
    where = f"{path}:{number}: {target}"
    if resolved.startswith(".."):
      problems.append(f"{where}: outside the repository")
      continue
    full = os.path.join(ROOT, resolved)
    if resolved != path and not os.path.exists(full):
      problems.append(f"{where}: no file {resolved}")
      continue
    if fragment:
      if not resolved.endswith(".md"):
        problems.append(f"{where}: #{fragment} on a page that is not Markdown")
        continue
      if resolved not in anchor_cache:
        anchor_cache[resolved] = anchors(read(resolved))
      if fragment not in anchor_cache[resolved]:
        problems.append(f"{where}: {resolved} has no heading #{fragment}")
  return problems


# The blocks this file runs: name -> the test method that runs it.
RUNNERS = {
    "fit-example": "test_readme_fit_example_trains",
    "feature-spec": "test_feature_spec_block_parses",
    "k8s-job-spec": "test_kubernetes_job_spec_prints_the_documented_tfjob",
    "k8s-job-spec-output": (
        "test_kubernetes_job_spec_prints_the_documented_tfjob"),
    "chaos-schedule": "test_chaos_schedule_block_prints_its_kills",
}
_K8S = "docs/platforms/kubernetes.md"


def find_block(path: str, name: str) -> str:
  """The code of the block marked `run: tests/docs_test.py NAME` in path."""
  found = [b["code"] for b in code_blocks(read(path))
           if b["marker"] == f"<!-- run: tests/docs_test.py {name} -->"]
  if len(found) != 1:
    raise AssertionError(f"{path}: {len(found)} blocks marked {name!r}")
  return found[0]


def marker_problems(path: str, text: str) -> list:
  """What is wrong with the run markers of one page's code blocks."""
  problems = []
  for block in code_blocks(text):
    where = f"{path}:{block['line']} (```{block['info']})"
    if not block["closed"]:
      problems.append(f"{where}: no closing fence")
    m = _MARKER.match(block["marker"])
    if not m:
      problems.append(
          f"{where}: no marker on the line above; add `<!-- not run: "
          "REASON -->` or `<!-- run: tests/X_test.py NAME -->`")
      continue
    kind, rest = m.groups()
    if kind == "not run":
      if not rest:
        problems.append(f"{where}: `not run:` without a reason")
      continue
    parts = rest.split()
    if len(parts) != 2:
      problems.append(f"{where}: `run:` needs a test file and a name, got "
                      f"{rest!r}")
      continue
    test_file, name = parts
    if test_file == "tests/docs_test.py":
      if name not in RUNNERS:
        problems.append(f"{where}: tests/docs_test.py runs no block {name!r}"
                        f" (it runs {sorted(RUNNERS)})")
      continue
    if not os.path.exists(os.path.join(ROOT, test_file)):
      problems.append(f"{where}: no test file {test_file}")
      continue
    with open(os.path.join(ROOT, test_file), encoding="utf-8") as f:
      source = f.read()
    if name not in source or os.path.basename(path) not in source:
      problems.append(f"{where}: {test_file} does not read this block "
                      f"(its source must name both {name!r} and "
                      f"{os.path.basename(path)!r})")
  return problems


def _child_env(data_dir: str) -> dict:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TFDIST_DATA_DIR=data_dir)
  env["PYTHONPATH"] = os.pathsep.join(
      [testutil.REPO_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  return env


class DocsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # The two children run at once; each test waits for its own.
    scratch = testutil.scratch_dir()
    cls.deadline = time.monotonic() + _CHILD_DEADLINE
    cls.fit_dir = os.path.join(scratch, "my_run")
    example = find_block("README.md", "fit-example")
    assert example.count('"/tmp/my_run"') == 1, example
    script = os.path.join(scratch, "fit_example.py")
    with open(script, "w") as f:
      f.write(example.replace('"/tmp/my_run"', repr(cls.fit_dir)))
    cls.fit = subprocess.Popen(
        [sys.executable, script], cwd=scratch,
        env=_child_env(os.path.join(scratch, "data")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cls.train_args = cls._quick_start_train_args()
    cls.quick_model_dir = os.path.join(scratch, "quick_start")
    args = [a if not a.startswith("--model_dir=") else
            "--model_dir=" + cls.quick_model_dir for a in cls.train_args]
    cls.dry_run = subprocess.Popen(
        [sys.executable, "-m", "tfdist.train", *args, "--dry_run"],
        cwd=testutil.REPO_ROOT,
        env=_child_env(os.path.join(scratch, "quick_data")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The job spec command, without its `> tfjob.yaml`: stdout is the file.
    command = find_block(_K8S, "k8s-job-spec").replace("\\\n", " ").strip()
    assert command.endswith(" > tfjob.yaml"), command
    args = shlex.split(command[:-len(" > tfjob.yaml")])
    assert args[:3] == ["python", "-m", "tfdist.job_spec"], args
    cls.job_spec = subprocess.Popen(
        [sys.executable, *args[1:]], cwd=scratch,
        env=_child_env(os.path.join(scratch, "job_spec_data")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  @classmethod
  def tearDownClass(cls):
    for proc in (cls.fit, cls.dry_run, cls.job_spec):
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    super().tearDownClass()

  @staticmethod
  def _quick_start_blocks():
    blocks = [b["code"].strip() for b in code_blocks(read("README.md"))
              if b["code"].startswith("bash tools/setup.sh && ")]
    assert len(blocks) == 2, blocks
    return blocks

  @classmethod
  def _quick_start_train_args(cls):
    train = cls._quick_start_blocks()[0]
    prefix = "bash tools/setup.sh && .venv/bin/python -m tfdist.train "
    assert train.startswith(prefix), train
    return shlex.split(train[len(prefix):])

  def _finish(self, proc):
    """The child's stdout and stderr (None when merged into stdout)."""
    try:
      out, err = proc.communicate(
          timeout=max(1.0, self.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
      self.fail(f"{proc.args[1:4]} still running {_CHILD_DEADLINE} s after "
                f"the children started:\n{out[-2000:]}\n{(err or '')[-2000:]}")
    self.assertEqual(proc.returncode, 0, out[-4000:] + (err or "")[-3000:])
    return out, err

  def test_pending_pages_are_still_missing(self):
    # Once a pending page exists its links are checked like any other.
    present = [p for p in PENDING if os.path.exists(os.path.join(ROOT, p))]
    self.assertEqual(present, [], "these pages exist now: remove them from "
                     "PENDING in tests/docs_test.py")

  def test_links_resolve(self):
    cache, problems = {}, []
    for path in doc_files():
      problems += link_problems(path, read(path), cache)
    self.assertEqual(problems, [], "\n".join(problems))

  def test_every_code_block_runs_or_says_why_not(self):
    problems = []
    for path in doc_files():
      problems += marker_problems(path, read(path))
    self.assertEqual(problems, [], "\n".join(problems))
    # Each block this file claims to run is there, once.
    claimed = {name: [p for p in doc_files()
                      if f"<!-- run: tests/docs_test.py {name} -->" in read(p)]
               for name in RUNNERS}
    for name, paths in claimed.items():
      self.assertLen(paths, 1, f"{name}: marked in {paths}")
      self.assertTrue(hasattr(self, RUNNERS[name]), name)

  def test_readme_fit_example_trains(self):
    out, _ = self._finish(self.fit)
    printed = float(out.strip().splitlines()[-1])   # eval_mae
    self.assertTrue(math.isfinite(printed), out[-2000:])
    with open(os.path.join(self.fit_dir, "run_manifest.json")) as f:
      manifest = json.load(f)
    self.assertEqual(manifest["final_step"], 500)
    self.assertAlmostEqual(manifest["final_metrics"]["eval_mae"], printed,
                           places=5)

  def test_quick_start_commands(self):
    # The training command: every start-up check passes on the real data.
    out, _ = self._finish(self.dry_run)
    self.assertIn("tfdist: dry run: every start-up check passed", out)
    self.assertIn("60000 training and 10000 evaluation examples", out)
    self.assertRegex(out, r"learning rate .* cosine after warmup")
    self.assertIn("--train_epochs=3", self.train_args)
    # The test command is what CI runs.
    ci = [line.strip() for line in read(".ci/run").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    self.assertEqual(ci[-1], self._quick_start_blocks()[1])

  def test_kubernetes_job_spec_prints_the_documented_tfjob(self):
    out, _ = self._finish(self.job_spec)
    self.assertEqual(out, find_block(_K8S, "k8s-job-spec-output"))

  def test_feature_spec_block_parses(self):
    # Imported here, not at the top: TensorFlow then loads in this process
    # while the two children (started in setUpClass) already run.
    from tfdist.data import feature_spec  # pylint: disable=g-import-not-at-top
    block = find_block("docs/guides/your-model.md", "feature-spec")
    spec = feature_spec.from_dict(json.loads(block))
    self.assertEqual(tuple(spec.labels), ("tags",))
    self.assertEqual(sorted(f.name for f in spec.features),
                     ["channel", "signal", "tags"])

  def test_chaos_schedule_block_prints_its_kills(self):
    block = find_block("docs/benchmarks/chaos.md", "chaos-schedule")
    proc = subprocess.run(
        [sys.executable, "-c", block], cwd=testutil.REPO_ROOT,
        env=_child_env(testutil.scratch_dir()), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    kills = [line for line in proc.stdout.splitlines() if "Kill" in line]
    self.assertLen(kills, 4, proc.stdout[-3000:])

  # The checks themselves, on small pages: each fails on what it must catch.
  def test_link_check_catches_a_missing_file_and_anchor(self):
    page = ("# Top\n\n## A `code` heading: yes!\n\n## Dup\n\n## Dup\n\n"
            "[ok](#top) [ok](#a-code-heading-yes) [ok](#dup-1) "
            "[bad](#nope) [bad](missing.md) [ok](README.md#guides) "
            "[pending](design/long-runs.md)\n\n"
            "```sh\n[x](not-a-link.md)\n```\n")
    problems = link_problems("docs/page.md", page, {})
    self.assertLen(problems, 2, problems)
    self.assertIn("has no heading #nope", problems[0])
    self.assertIn("no file docs/missing.md", problems[1])
    self.assertEqual(link_problems("docs/README.md",
                                   "[x](../README.md#quick-start-fresh-debian-"
                                   "machine-two-commands)", {}), [])

  def test_marker_check_catches_unmarked_and_unrun_blocks(self):
    page = ("```sh\necho 1\n```\n\n<!-- not run: -->\n```sh\necho 2\n```\n\n"
            "<!-- run: tests/docs_test.py nothing -->\n```py\nx\n```\n\n"
            "<!-- run: tests/lr_schedule_test.py warmup -->\n```py\nx\n```\n\n"
            "<!-- not run: a diagram -->\n```mermaid\nflowchart\n```\n\n"
            "<!-- not run: output -->\n```\nno end\n")
    problems = marker_problems("docs/page.md", page)
    self.assertLen(problems, 5, problems)
    self.assertIn("no marker", problems[0])
    self.assertIn("without a reason", problems[1])
    self.assertIn("runs no block 'nothing'", problems[2])
    self.assertIn("does not read this block", problems[3])
    self.assertIn("no closing fence", problems[4])


if __name__ == "__main__":
  absltest.main()
