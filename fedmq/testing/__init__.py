"""Check your own method, model or dataset against the contract fedmq's built-in ones keep.

    from fedmq.testing import check_method, check_model, check_dataset

    def test_my_method() -> None:
        check_method("my_package.my_method", {"power": 0.5})

Each raises `ContractError` (an AssertionError) naming the broken promise; `fedmq.testing.contract`
lists them, and `fedmq.testing.federation` is the in-process federation a method is run in.
"""

from __future__ import annotations

from fedmq.testing.contract import ContractError, check_dataset, check_method, check_model

__all__ = ["ContractError", "check_dataset", "check_method", "check_model"]
