import pytest

from vmplane.core.errors import Invalid, NotFound
from vmplane.core.settings import KEYS, parse_value, resolve


def test_cluster_beats_zone_beats_global_beats_default():
    key = "mem.overprovisioning.factor"
    values = {("global", None): "1.2", ("zone", "z1"): "1.3", ("cluster", "c1"): "1.5"}
    assert resolve(key, values, zone="z1", cluster="c1") == 1.5
    assert resolve(key, values, zone="z1", cluster="c2") == 1.3
    assert resolve(key, values, zone="z2", cluster="c3") == 1.2
    assert resolve(key, {}, zone="z2", cluster="c3") == 1.0


def test_reference_system_keys_and_defaults():
    assert KEYS["enable.dynamic.scale.vm"].default is False
    assert KEYS["auto.migrate.vm.on.live.scale.insufficient.capacity"].default is True
    assert KEYS["kvm.cpu.dynamic.scaling.capacity"].default == 0
    assert KEYS["vmplane.migration.max.per.cluster"].default == 5
    assert KEYS["vmplane.migration.max.outbound.per.host"].default == 2


def test_a_zone_scoped_key_cannot_be_set_per_cluster():
    with pytest.raises(Invalid, match="not cluster") as exc:
        parse_value("enable.dynamic.scale.vm", "cluster", "true")
    assert exc.value.field == "scope"


@pytest.mark.parametrize(
    "key,value",
    [
        ("cpu.overprovisioning.factor", "0"),
        ("cpu.overprovisioning.factor", "x"),
        ("enable.dynamic.scale.vm", "maybe"),
        ("vmplane.placement.strategy", "random"),
        ("vmplane.migration.max.per.cluster", "-1"),
    ],
)
def test_bad_values_are_refused_naming_the_value(key, value):
    with pytest.raises(Invalid) as exc:
        parse_value(key, "global", value)
    assert exc.value.field == "value" and key in exc.value.message


def test_unknown_keys_are_not_found():
    with pytest.raises(NotFound):
        parse_value("no.such.key", "global", "1")
