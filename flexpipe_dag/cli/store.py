"""``flexpipe store``: the store's schema: show its revision, upgrade, downgrade (refused when it would drop data
unless --force) and repair a half-migrated store; prune the metric samples older than the retention, the uploaded
files that have expired and the results of batches whose output files have. The store is FLEXPIPE_DATABASE_URL or
SQLite under FLEXPIPE_HOME."""

from __future__ import annotations

import argparse

from flexpipe_dag.core.settings import DEFAULT_SAMPLE_RETENTION_DAYS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="show, upgrade, downgrade or repair the store's schema",
                       description=__doc__.replace("``", ""))
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("status", help="print the store (password hidden) and its schema revision")
    actions.add_parser("upgrade", help="upgrade the schema to this FlexPipe's head")
    down = actions.add_parser("downgrade", help="downgrade the schema to REVISION (refused if it drops data)")
    down.add_argument("revision", help="target revision, e.g. 0006, or 'base' (drops every table)")
    down.add_argument("--force", action="store_true", help="downgrade even though it drops the data it names")
    rep = actions.add_parser("repair", help="drop the tables of a half-migrated store (no schema version) and "
                                            "create the schema afresh")
    rep.add_argument("--force", action="store_true", help="drop them even though they hold rows")
    prune = actions.add_parser("prune", help="delete the metric samples written before the retention window, the "
                                             "expired uploaded files no running batch reads and the results of "
                                             "batches whose output files expired")
    prune.add_argument("--keep-days", type=float, default=None,
                       help="retention, days (default FLEXPIPE_SAMPLE_RETENTION_DAYS, else "
                            f"{DEFAULT_SAMPLE_RETENTION_DAYS:g}; at least 1 hour)")
    prune.add_argument("--dry-run", action="store_true", help="count the rows that would go, delete nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flexpipe_dag.core.errors import one_line
    from flexpipe_dag.core.settings import database_url, sample_retention_s
    from flexpipe_dag.sql.engine import missing_sqlite_file, opening_errors
    from flexpipe_dag.sql.store import (
        Store,
        check_store_url,
        current_revision,
        downgrade,
        head_revisions,
        make_engine,
        migrate,
        repair,
    )

    keep_s = sample_retention_s(args.keep_days) if args.action == "prune" else None  # checked before the store opens
    url = database_url()
    shown = check_store_url(url)
    missing = missing_sqlite_file(url)
    if missing is not None and (args.action == "status" or (args.action == "prune" and args.dry_run)):
        print(f"store {one_line(shown)}: no database file at {one_line(str(missing))} yet (it is made on first use); "
              + ("nothing to prune" if args.action == "prune" else "schema revision none"))
        return 0  # looking writes nothing: not even an empty file at a mistyped path
    with opening_errors(shown, url):
        engine = make_engine(url)
        try:
            if args.action == "upgrade":
                migrate(engine)
            elif args.action == "downgrade":
                for loss in downgrade(engine, args.revision, force=args.force):
                    print(f"dropped {loss}")
            elif args.action == "prune":
                assert keep_s is not None
                # a dry run writes nothing, not even a schema upgrade
                store = Store(engine, auto_migrate=not args.dry_run)
                print(store.prune_samples(keep_s, dry_run=args.dry_run).describe())
                revision = current_revision(engine)
                if revision in head_revisions():
                    print(store.prune_api_files(dry_run=args.dry_run).describe())
                    print(store.prune_batch_results(dry_run=args.dry_run).describe())
                else:  # a dry run on a store not upgraded yet: its files carry no expiry
                    print(f"uploaded files and batch results: none expire at schema revision {revision} (upgrade the "
                          "store first)")
                return 0
            elif args.action == "repair":
                for name, rows in repair(engine, force=args.force).items():
                    print(f"dropped unversioned table {name} ({rows} rows)")
            print(f"store {one_line(shown)}: schema revision {current_revision(engine) or 'none'} "
                  f"(this FlexPipe's head: {', '.join(head_revisions())})")
        finally:
            engine.dispose()
    return 0
