"""A third-party batchyard plugin package, installed by the test command with `pip install -e`."""
