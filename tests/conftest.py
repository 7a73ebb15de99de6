import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_compile_cache(tmp_path_factory):
    """Tests compile into their own cache so that a cold cache is really cold and nothing leaks out."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MAGE_GEN_CACHE", str(tmp_path_factory.mktemp("nvrtc-cache")))
    yield
    mp.undo()
