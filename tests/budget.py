"""How hard the property tests search, chosen by the environment and shared by every test file.

- default (`ci`): derandomized, so every run draws the same examples and a commit passes or fails the same way each
  time; nothing of hypothesis's in the checkout (its home is ~/.cache/dsv41-nb/hypothesis).
- `DSV41_SLOW=1` (`slow`): fresh randomness, four times the examples, the database outside the checkout; a failure it
  finds prints its reproduction and becomes an explicit `@example` or a pinned test.
- `DSV41_EXAMPLES=F` scales every test's example count by F (the GPU tier runs fewer: each new shape compiles)."""
import os
from pathlib import Path
from hypothesis import settings, HealthCheck
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.database import DirectoryBasedExampleDatabase

SLOW = bool(os.environ.get('DSV41_SLOW'))
SCALE = float(os.environ.get('DSV41_EXAMPLES') or (4 if SLOW else 1))
if not SCALE > 0: raise ValueError(f"DSV41_EXAMPLES={os.environ['DSV41_EXAMPLES']!r}: expected a positive number")

def examples(n: int) -> int:
    "A test's example count `n`, scaled by the run's budget (at least 1)"
    return max(1, round(n * SCALE))

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile('ci', max_examples=examples(60), derandomize=True, database=None, **_common)
_db = Path(os.environ.get('XDG_CACHE_HOME', Path.home() / '.cache')) / 'dsv41-nb' / 'hypothesis'
set_hypothesis_home_dir(_db)                 # its caches (constants, unicode data) outside the checkout too
settings.register_profile('slow', max_examples=examples(250), database=DirectoryBasedExampleDatabase(_db), **_common)
settings.load_profile('slow' if SLOW else 'ci')
