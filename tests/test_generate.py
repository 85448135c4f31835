"""generate.py: what sampling refuses. Generation itself (greedy against recomputation, EOS, top-k
and seeds) runs through each model's generate in test_flint_model.py and test_large4.py."""

import pytest

from generate import check_sampling


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 1e-45, -0.5])
def test_sampling_refuses_temperatures_that_make_nan_probabilities(temperature):
    with pytest.raises(ValueError, match="temperature must be"):
        check_sampling(temperature, None)
    check_sampling(0, None)
    check_sampling(0.8, 5)
