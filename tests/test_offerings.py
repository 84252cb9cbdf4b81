import pytest

from vmplane.core.errors import Invalid
from vmplane.core.model import Offering, OfferingKind, Size
from vmplane.core.offerings import size_for, validate_offering

FIXED = Offering("f", OfferingKind.fixed, vcpus=2, memory_mib=2048)
RANGED = Offering(
    "r", OfferingKind.custom_constrained, min_vcpus=1, max_vcpus=4, min_memory_mib=512, max_memory_mib=4096
)
ANY = Offering("u", OfferingKind.custom_unconstrained)


def test_fixed_offering_gives_its_size_and_refuses_other_values():
    assert size_for(FIXED, None, None) == Size(2, 2048)
    assert size_for(FIXED, 2, 2048) == Size(2, 2048)
    with pytest.raises(Invalid) as exc:
        size_for(FIXED, 4, None)
    assert exc.value.field == "vcpus"


@pytest.mark.parametrize(
    "vcpus,memory,field",
    [
        (5, 1024, "vcpus"),
        (0, 1024, "vcpus"),
        (2, 256, "memory_mib"),
        (2, 8192, "memory_mib"),
        (None, 1024, "vcpus"),
        (2, None, "memory_mib"),
        (-1, 1024, "vcpus"),
    ],
)
def test_custom_constrained_values_outside_the_range_are_refused(vcpus, memory, field):
    with pytest.raises(Invalid) as exc:
        size_for(RANGED, vcpus, memory)
    assert exc.value.field == field


def test_custom_values_inside_the_range_and_unconstrained_are_taken():
    assert size_for(RANGED, 4, 512) == Size(4, 512)
    assert size_for(ANY, 64, 1 << 20) == Size(64, 1 << 20)


@pytest.mark.parametrize(
    "offering,field",
    [
        (Offering("a", OfferingKind.fixed, vcpus=2), "memory_mib"),
        (Offering("a", OfferingKind.fixed, vcpus=2, memory_mib=0), "memory_mib"),
        (Offering("a", OfferingKind.fixed, vcpus=2, memory_mib=512, min_vcpus=1), "min_vcpus"),
        (
            Offering("a", OfferingKind.custom_constrained, min_vcpus=1, max_vcpus=4, min_memory_mib=512),
            "max_memory_mib",
        ),
        (
            Offering(
                "a", OfferingKind.custom_constrained, min_vcpus=5, max_vcpus=4, min_memory_mib=512, max_memory_mib=1024
            ),
            "min_vcpus",
        ),
        (Offering("a", OfferingKind.custom_unconstrained, vcpus=2), "vcpus"),
    ],
)
def test_invalid_offerings_name_the_field(offering, field):
    with pytest.raises(Invalid) as exc:
        validate_offering(offering)
    assert exc.value.field == field
