"""`python -m tfdist.diagnose`: the binary (`tfdist.diagnose.cli`)."""

from tfdist.diagnose import cli

if __name__ == "__main__":
  cli.run()
