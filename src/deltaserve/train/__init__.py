"""The training side: activation buffer, backward worker process, AdamW, PEFT checkpoints, and
the co-server that ties them to a host through the contract in :mod:`deltaserve.core.contract`."""
