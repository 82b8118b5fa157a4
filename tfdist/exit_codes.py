"""Exit codes of `tfdist.train`: a contract with cluster managers.

The statuses, their table and `exit_code_for` live with the error classes
in `tfdist.errors` (their one home); this module keeps the documented names
`tfdist.exit_codes.CONFIG`, `exit_code_for`, `is_retryable`, ... working.
"""

from tfdist.errors import CONFIG
from tfdist.errors import DIVERGED
from tfdist.errors import exit_code_for
from tfdist.errors import is_retryable
from tfdist.errors import KILLED
from tfdist.errors import LEASE_HELD
from tfdist.errors import OK
from tfdist.errors import PEER_LOST
from tfdist.errors import RETRYABLE_FROM
from tfdist.errors import UNEXPECTED

__all__ = ["CONFIG", "DIVERGED", "KILLED", "LEASE_HELD", "OK", "PEER_LOST",
           "RETRYABLE_FROM", "UNEXPECTED", "exit_code_for", "is_retryable"]
