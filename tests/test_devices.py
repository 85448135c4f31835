import pytest
import torch

from devices import kernel_device_type, targeting


def test_kernels_follow_the_tensors_device_unless_a_rehearsal_targets_one():
    assert kernel_device_type(torch.device("cpu")) == "cpu"
    assert kernel_device_type("meta") == "meta"
    with targeting("cuda"):
        assert kernel_device_type(torch.device("cpu")) == "cuda"
    assert kernel_device_type("cpu") == "cpu"


def test_the_target_is_restored_after_an_error():
    with pytest.raises(RuntimeError), targeting("cuda"):
        raise RuntimeError("stop")
    assert kernel_device_type("cpu") == "cpu"
