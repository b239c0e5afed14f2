import pytest

from tests.tiny import hf_tiny_llama


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face model directory."""
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=7).save_pretrained(path)
    return path
