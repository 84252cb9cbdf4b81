"""Security groups in the store (store/secgroups.py): the default group, rules, membership, deletes refused
while in use."""

import pytest

from vmplane.core.errors import AlreadyExists, Conflict, NotFound
from vmplane.core.networks import Rule, parse_rule
from vmplane.store import ledger as L
from vmplane.store import networks as NW
from vmplane.store import secgroups as SG

from .conftest import add_basics, add_sim_hosts


@pytest.fixture
def project(orch):
    add_sim_hosts(orch, 1)
    add_basics(orch)
    orch.catalog.create_project("a", 100, 1 << 20, 100, count_overhead=False)
    with orch.db.read() as s:
        return orch, L.lock_project(s.connection(), name="a").id


def test_the_default_group_is_made_once_and_lets_members_in_and_everything_out(project):
    o, pid = project
    with o.db.transaction() as conn:
        first = SG.ensure_default(conn, pid)
        assert SG.ensure_default(conn, pid) == first
        rules = [r.rule for r in SG.rules_of(conn, pid, "default")]
    assert rules == [Rule("in", "any", group="default"), Rule("out", "any", cidr="0.0.0.0/0")]


def test_rules_are_added_and_removed_by_id_and_name_groups_of_their_own_project(project):
    o, pid = project
    with o.db.transaction() as conn:
        SG.create_group(conn, pid, "web")
        with pytest.raises(AlreadyExists):
            SG.create_group(conn, pid, "web")
        ssh = SG.add_rule(conn, pid, "web", parse_rule("in", "tcp", "22", "192.0.2.0/24"))
        with pytest.raises(NotFound) as err:
            SG.add_rule(conn, pid, "web", parse_rule("in", "tcp", "80", group="nope"))
        assert err.value.field == "secgroup"
        SG.remove_rule(conn, pid, "web", ssh)
        with pytest.raises(NotFound, match=f"no rule {ssh}"):
            SG.remove_rule(conn, pid, "web", ssh)
        assert SG.rules_of(conn, pid, "web") == []


def test_a_group_in_use_is_not_deleted_and_the_refusal_names_what_uses_it(project):
    o, pid = project
    o.create_vm("v1", "a", "small", "tiny")
    with o.db.transaction() as conn:
        zone = o.catalog.zones()[0].id
        NW.create_network(conn, "n", "isolated", zone, "10.0.0.0/24", project_id=pid)
        nic = NW.add_nic(conn, o.vm("v1").id, "n")
        web = SG.create_group(conn, pid, "web")
        SG.create_group(conn, pid, "db")
        SG.add_rule(conn, pid, "db", parse_rule("in", "tcp", "5432", group="web"))
        SG.join(conn, nic.id, web)
        SG.join(conn, nic.id, web)  # once
        assert SG.groups_of(conn, nic.id) == ["web"]
    for name, words in (("web", "in use by the NICs of v1"),):
        with pytest.raises(Conflict, match=words), o.db.transaction() as conn:
            SG.delete_group(conn, pid, name)
    with o.db.transaction() as conn:
        SG.leave(conn, nic.id, web)
        with pytest.raises(Conflict, match="named by the rules of db"):
            SG.delete_group(conn, pid, "web")
        SG.delete_group(conn, pid, "db")  # its rules go with it
        SG.delete_group(conn, pid, "web")
        SG.ensure_default(conn, pid)
        SG.delete_group(conn, pid, "default")  # its own rule naming itself does not hold it
        with pytest.raises(NotFound):
            SG.rules_of(conn, pid, "web")
