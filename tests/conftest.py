import os

import jax
import pytest
from hypothesis import Phase, settings

# The mutation check (.ci/mutations.py) only needs to know that a property fails, not the
# smallest failing example: no shrinking there.
if os.environ.get("DEFERAX_MUTATION_CHECK"):
    settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], deadline=None)
    settings.load_profile("mutation")

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def counter():
    from .helpers import Counter

    return Counter()


@pytest.fixture(autouse=True)
def no_timings():
    """Each test starts with no timings of earlier calls (every host site times its jobs,
    and a site's timings, kept by name and input shapes, would change another test's plan)."""
    import deferax as dx

    dx.forget_timings()
    yield
    dx.forget_timings()
