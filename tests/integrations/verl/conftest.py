"""tests/integrations/verl run in the verl venv (`make test-verl`), where verl is required; elsewhere they
are skipped as a whole, because verl pins a transformers range the main environment does not meet."""

import importlib.util
import os

if importlib.util.find_spec("verl") is None:
    if os.environ.get("OTBRL_REQUIRE_VERL") == "1":
        raise ImportError("verl is not installed, but OTBRL_REQUIRE_VERL=1 (make test-verl) requires it")
    collect_ignore_glob = ["test_*.py"]
