import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmplane.core.units import format_mib, parse_mib


@pytest.mark.parametrize(
    "text,mib",
    [
        ("512MiB", 512),
        ("16GiB", 16384),
        ("2048", 2048),
        (" 1 TiB ", 1048576),
        ("1.5GiB", 1536),
        ("4gib", 4096),
        ("256Mi", 256),
        ("2Gi", 2048),
        (64, 64),
    ],
)
def test_sizes_in_binary_units_parse_to_mib(text, mib):
    assert parse_mib(text) == mib


@pytest.mark.parametrize(
    "text,words",
    [
        ("16GB", "ambiguous"),
        ("512MB", "ambiguous"),
        ("12XB", "unknown unit"),
        ("2G", "ambiguous"),
        ("512M", "ambiguous"),
        ("abc", "not a size"),
        ("", "not a size"),
        ("-5GiB", "not a size"),
        ("0", "greater than zero"),
        ("0.3MiB", "whole number"),
    ],
)
def test_bad_sizes_are_refused_with_the_reason(text, words):
    with pytest.raises(ValueError, match=words):
        parse_mib(text)


@given(st.integers(min_value=1, max_value=2**40))
def test_format_then_parse_is_identity(mib):
    assert parse_mib(format_mib(mib).replace(" ", "")) == mib
