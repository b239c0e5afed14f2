"""The backward process, owned by :class:`deltaserve.train.trainer.Trainer`: the driver (the grant
around host steps, job submission, outcomes), the spawned process and its worker loop, the
layer-wise recompute and backward, validation, and the messages between the two sides. Nothing
outside this package starts the process (``tests/test_architecture.py`` checks it)."""
