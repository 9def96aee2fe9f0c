"""What every experiment's results.json must hold for two results to be compared (issue 23 item 3)."""
import re


def assert_comparable_record(record: dict) -> None:
    """The record names its protocol and the fingerprint of the test split it was scored on."""
    assert isinstance(record.get("protocol"), str) and record["protocol"], record.get("protocol")
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", record.get("test_split_fingerprint", "")), \
        record.get("test_split_fingerprint")
