"""docs/configuration.md lists every setting of every service, with its flag, environment
variable, default and the services that read it, as the services' parsers define them. The last
column (what it means) is prose and not compared."""

from __future__ import annotations

from .artifacts import REPO, SERVICES, settings

DOC = REPO / "docs/configuration.md"
LABELS = {"request-manager": "request manager", "ssm-worker": "SSM worker", "llm-verifier": "LLM verifier"}
HOST_DEPENDENT = {"--owner": "(host name)"}


def show(value: object) -> str:
    if value is None:
        return "(none)"
    if value == "":
        return "(empty)"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def expected_rows() -> dict[str, tuple[str, str, str]]:
    """Flag -> (environment variable, default, services), as the parsers define them."""
    by_flag: dict[str, dict[str, object]] = {}
    envs = {}
    for service in SERVICES:
        for env, setting in settings(service).items():
            by_flag.setdefault(setting.flag, {})[service] = setting.default
            envs[setting.flag] = env
    rows = {}
    for flag, defaults in by_flag.items():
        services = "all" if len(defaults) == len(SERVICES) else ", ".join(LABELS[s] for s in defaults)
        if flag in HOST_DEPENDENT:
            default = HOST_DEPENDENT[flag]
        elif len({show(d) for d in defaults.values()}) == 1:
            default = show(next(iter(defaults.values())))
        else:
            default = "; ".join(f"{LABELS[s]}: {show(d)}" for s, d in defaults.items())
        rows[f"`{flag}`"] = (f"`{envs[flag]}`", default, services)
    return rows


def documented_rows() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `--") and len(cells) == 5:
            assert cells[0] not in rows, f"{cells[0]} is documented twice"
            rows[cells[0]] = tuple(cells[1:4])
    return rows


def test_every_setting_is_documented_as_the_parsers_define_it():
    expected, documented = expected_rows(), documented_rows()
    missing = {flag: row for flag, row in expected.items() if documented.get(flag) != row}
    extra = set(documented) - set(expected)
    assert not missing and not extra, (
        "docs/configuration.md is out of date; expected rows (flag | env | default | services):\n"
        + "\n".join(f"| {flag} | {' | '.join(row)} | ... |" for flag, row in missing.items())
        + (f"\nnot settings any more: {sorted(extra)}" if extra else "")
    )
