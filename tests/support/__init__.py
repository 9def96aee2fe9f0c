"""What the tests share: forked `python -m` runs, baselines, records, the Keras loss contract, the
serving exports and the system contract."""
