"""`make models`: every zoo model converted with and without our passes; prints the README's table."""

from __future__ import annotations

from pattern_infra.testing.models import ZOO
from pattern_infra.testing.real_models import compare_model, format_table


def main() -> None:
    rows = [compare_model(name) for name in ZOO]
    print(format_table(rows))
    for row in rows:
        changed = {t: (row.ops_off[t], row.ops_on[t]) for t in set(row.ops_off) | set(row.ops_on)
                   if row.ops_off[t] != row.ops_on[t]}
        if changed:
            detail = ", ".join(f"{t} {a}->{b}" for t, (a, b) in sorted(changed.items()))
            print(f"{row.name}: {detail}")


if __name__ == "__main__":
    main()
