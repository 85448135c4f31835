"""context_parallel.py: which positions each cp rank computes (the gather itself runs in every
context-parallel layout of tests/test_parallel.py, against one process)."""

from context_parallel import cp_token_index


def test_cp_token_index_balances_causal_work():
    chunks = [cp_token_index(16, 2, r, "cpu").tolist() for r in range(2)]
    assert chunks == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert sum(chunks, []) != list(range(16)) and sorted(sum(chunks, [])) == list(range(16))
