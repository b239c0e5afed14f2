import pytest
import torch

from deltaserve.core import InputError
from deltaserve.model.config import ModelConfig
from deltaserve.train.buffer import ActivationBuffer, BufferConfig

CFG = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=3, num_heads=2,
                  num_kv_heads=1, head_dim=4)


def test_sizes_and_sharing():
    b = ActivationBuffer(BufferConfig(16), CFG, torch.float32)
    assert b.residual.shape == (3, 16, 8) and b.residual.is_shared()
    assert b.bytes_per_token == 3 * 8 * 4 and b.gate is None
    m = ActivationBuffer(BufferConfig(16, "residual+mlp"), CFG, torch.bfloat16)
    assert m.bytes_per_token == 3 * (8 + 24) * 2 and m.gate.shape == (3, 16, 12)


def test_writes_land_in_their_rows():
    b = ActivationBuffer(BufferConfig(10), CFG, torch.float32)
    rows = torch.arange(24, dtype=torch.float32).view(3, 8)
    b.write_residual(1, 4, rows)
    assert torch.equal(b.residual[1, 4:7], rows)
    assert b.residual[0].abs().sum() == 0 and b.residual[1, :4].abs().sum() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, offload is valid")
def test_offload_needs_a_gpu():
    with pytest.raises(InputError) as e:
        ActivationBuffer(BufferConfig(10, offload=True), CFG, torch.float32)
    assert e.value.field == "buffer_offload"


def test_config_validation():
    with pytest.raises(InputError):
        BufferConfig(0)
    with pytest.raises(InputError):
        BufferConfig(10, save="everything")
