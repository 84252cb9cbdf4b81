"""The CLI's errors speak in flags only where the field came from a flag (issue 33's audit): a refused
input (422 `invalid`) whose field is a flag; a quota, a conflict, a setting or a sort key keep the API's
words (`vm list --sort memory` once advised `--memory`, a quota was "`--memory` quota exceeded")."""

from __future__ import annotations

import pytest

from vmplane.cli.common import in_cli_words


@pytest.mark.parametrize(
    "body,said",
    [
        (  # the input a flag gives: the flag
            {"error": "invalid", "field": "memory_mib", "message": "offering flex is custom: memory_mib is required"},
            {"field": "--memory", "message": "offering flex is custom: --memory is required"},
        ),
        (
            {"error": "invalid", "field": "min_memory_mib", "message": "min_memory_mib 9 is above max_memory_mib 8"},
            {"field": "--min-memory", "message": "--min-memory 9 is above --max-memory 8"},
        ),
        (  # a sort key is not a flag: the API's list of keys stays as it is
            {
                "error": "invalid",
                "field": "sort",
                "message": "sort: unknown field 'memory'; sort by one of name, vcpus, memory_mib",
            },
            {"field": "sort", "message": "sort: unknown field 'memory'; sort by one of name, vcpus, memory_mib"},
        ),
        (  # a quota is not a flag
            {
                "error": "quota_exceeded",
                "field": "memory_mib",
                "message": "project stor: memory_mib quota exceeded: 0 MiB used + 300 MiB asked > quota 16 MiB",
            },
            {"field": "memory_mib", "message": "project stor: memory_mib quota exceeded: 0 MiB used + 300 MiB asked"},
        ),
        (  # nor an offering's or a setting's property
            {
                "error": "conflict",
                "field": "dynamic_scaling",
                "message": "setting enable.dynamic.scale.vm is false in zone z1; dynamic_scaling can not be used",
            },
            {"field": "dynamic_scaling", "message": "setting enable.dynamic.scale.vm is false in zone z1"},
        ),
        (  # a setting's key that contains a field's name is not rewritten
            {"error": "invalid", "field": "cpu_cap", "message": "cpu_cap: see setting vmplane.cpu_cap.mode"},
            {"field": "--cpu-cap", "message": "--cpu-cap: see setting vmplane.cpu_cap.mode"},
        ),
    ],
)
def test_errors_name_a_flag_only_where_the_field_came_from_that_flag(body, said):
    out = in_cli_words(body)
    assert out["field"] == said["field"]
    assert out["message"].startswith(said["message"]), out["message"]
    assert out["error"] == body["error"]
