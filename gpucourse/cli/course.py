"""The commands of the course around the runtime: ``lab``, ``fetch-course``, ``grade``, ``quiz``, ``progress``,
``workshop``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..files import write_atomic
from ..values import NON_NEGATIVE, POSITIVE, POSITIVE_NUMBER, SEED, Name, whole
from .common import UsageError, check_writable

GRADER_FAILED = 3  # exit status when the grader itself could not run: no grade given, not the learner's doing


def _graded_line(name: str, result: dict) -> str:
    """A learner's line as class grading finishes it: the score, and what could not be graded."""
    from ..grading.report import grader_failures

    missing = len(grader_failures(result))
    return (f"  {name:<12} {result['score']:>4}/{result['max_score']}" + (f", {missing} not graded" if missing else "")
            + f"  ({result['time_s']:.1f} s)")


def _say_not_graded(not_graded: dict, who: str) -> int:
    """One line on stderr for each exercise of each learner the grader could not run; the exit status."""
    for name, failures in sorted(not_graded.items()):
        for module, why in failures:
            print(f"gpucourse: could not grade {name} {module}: {why}", file=sys.stderr)
    if not not_graded:
        return 0
    print(f"gpucourse: the grader could not run for {len(not_graded)} {who}{'s' * (len(not_graded) > 1)} (not "
          f"their code): no grade written for those exercises (empty cells in the CSV, and an empty total); see to "
          f"the grader and grade again.", file=sys.stderr)
    return GRADER_FAILED


def cmd_lab(args) -> int:
    from ..course import lab

    if not lab.NOTEBOOKS.is_dir():
        raise UsageError(f"the course's notebooks are not at {lab.NOTEBOOKS}: run this from a checkout "
                         f"of the repository (pip install -e .).")
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise UsageError("JupyterLab is not installed in this Python: run 'make lab' (or pip install -e .).")
    argv = lab.server_argv(lab.NOTEBOOKS, port=args.port)
    lab.install_course_defaults()  # no news pop-up over the first notebook
    runtime = lab.kernels_runtime_folder()
    if runtime is not None:
        os.environ["JUPYTER_RUNTIME_DIR"] = str(runtime)
    print("gpucourse: serving the course on 127.0.0.1 with a token; open the URL Jupyter prints below.",
          file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


def cmd_fetch_course(args) -> int:
    from ..course import material

    try:
        written = material.fetch(args.folder)
    except material.FetchError as e:
        raise UsageError(str(e)) from None
    parts = {part: sum(1 for p in written if p.parent.name == part) for part in material.PARTS}
    print(f"gpucourse: {parts['notebooks']} notebooks and {parts['exercises']} exercises copied into {args.folder}; "
          f"open {args.folder}/notebooks/00_setup.ipynb, and check(\"ex01\") grades {args.folder}/exercises.")
    return 0


def cmd_grade(args) -> int:
    from ..grading import core, report, runner
    for key in args.exercises:
        try:
            core.find_exercise(key)
        except KeyError as e:
            raise UsageError(f"{e.args[0]}.") from None
    common = dict(timeout=args.timeout, seed=args.seed, memory_gb=args.memory_gb)
    if args.class_dir:
        if not args.out:
            raise UsageError("--class needs --out FILE.csv, where the grades go.")
        if args.json or args.path:
            raise UsageError("--class grades the learner folders inside it; --json and --path are for one folder "
                             "(each learner's results JSON goes next to the --out file).")
        if not os.path.isdir(args.class_dir):
            raise UsageError(f"--class {args.class_dir} is not a folder.")
        names = runner.learners(args.class_dir)
        if not names:
            raise UsageError(f"--class {args.class_dir} holds no learner folders (one sub-folder per learner).")
        check_writable(args.out, "--out")
        if runner.results_folder(args.out).exists() and not runner.results_folder(args.out).is_dir():
            raise UsageError(f"{runner.results_folder(args.out)} is a file; the learners' results go in a folder "
                             f"of that name.")
        print(f"grading {len(names)} learner{'s' * (len(names) > 1)} in {args.class_dir}, {args.jobs} at a time")

        def done(name, result):
            print(_graded_line(name, result), flush=True)

        out = runner.grade_class(args.class_dir, args.out, jobs=args.jobs, exercises=args.exercises or None,
                                 on_learner=done, **common)
        print(f"graded in {out['time_s']:.1f} s (seed {out['seed']}): grades in {out['csv']}, "
              f"each learner's results in {out['results_dir']}/")
        return _say_not_graded(out["not_graded"], "learner")
    if args.out or args.jobs != 1:
        raise UsageError("--out and --jobs are for grading a class (--class DIR).")
    folder = runner.find_folder(args.path)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder of exercises; give one with --path.")
    if args.json:
        check_writable(args.json, "--json")
    result = runner.grade(folder, args.exercises or None, **common)
    # Your own exercises/: the hints climb a rung with your tries (report.LADDER); another folder shows them all.
    # Where the grader could not run, the first line says so and why.
    print(report.text_report(result, tries=runner.tries(result) if args.path is None else None))
    if args.path is None:  # your own exercises/: the scores go to your progress file
        note = runner.record_progress(result)
        if note:
            print(note)
    not_graded = report.grader_failures(result)
    if args.json and not_graded:
        print(f"results not written to {args.json}: the grader could not run, so there is no grade to write")
    elif args.json:
        write_atomic(args.json, json.dumps(report.gradescope(result), indent=1))
        print(f"results written to {args.json}")
    if not_graded:
        return GRADER_FAILED
    return 0 if result["score"] == result["max_score"] else 1


def cmd_quiz(args) -> int:
    from .. import quiz

    if args.review and (args.exam or args.export):
        raise UsageError("--review asks again the questions you missed; leave out --exam and --export.")
    if args.export:
        check_writable(args.export, "--export")
        n = quiz.export_bank(args.export, args.topic)
        print(f"{n} questions written to {args.export}")
        return 0
    from ..quiz import terminal

    if args.review:
        from ..course import progress
        from ..quiz import review

        try:
            record = progress.load()
            questions = review.draw(record, args.topic, args.count, args.seed)
        except ValueError as e:  # no answers recorded yet, or an unreadable progress file
            raise UsageError(str(e)) from None
        if questions:
            terminal.run_quiz(questions, "review")
        else:
            print(review.nothing_due(record, args.topic))
        return 0
    if args.exam:
        if args.topic:
            raise UsageError("--exam spans every topic; leave out --topic.")
        try:  # at most quiz.most_questions(): the exam's topic weights, single and multiple choice only
            exam = quiz.mock_exam(args.count or 40, args.seed)
        except ValueError as e:
            raise UsageError(str(e)) from None
        terminal.run_exam(exam)
    else:
        terminal.run_quiz(quiz.ask(args.topic, args.count or 10, args.seed), args.topic or "mixed")
    return 0


def cmd_progress(args) -> int:
    from ..course import progress
    from ..quiz import review

    try:
        if args.reset:
            had = progress.reset()
            print(f"progress reset: {progress.progress_path()} {'removed' if had else 'held nothing yet'}.")
            return 0
        summary = review.summary()
    except progress.ProgressError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(summary, indent=1) if args.json else review.format_summary(summary))
    return 0


def cmd_workshop(args) -> int:
    from ..workshop import collect, hub, kernels, report
    from ..workshop.errors import WorkshopError

    try:
        if args.action == "start":
            users = [u.strip() for u in args.users.split(",") if u.strip()] if args.users else None
            started = hub.start(args.dir, seats=args.seats, gpus_per_seat=args.gpus_per_seat, port=args.port,
                                public=args.public, password=args.password, users=users, admin=args.admin,
                                new_codes=args.new_codes, spawner=args.spawner, partition=args.partition,
                                gres=args.gres, time_limit=args.time,
                                say=lambda line: print(line, file=sys.stderr, flush=True))
            if started["public"]:  # asked now, or kept from the workshop's last start
                print(f"gpucourse: warning: {hub.PUBLIC_WARNING}", file=sys.stderr)
            print(hub.format_started(started))
        elif args.action == "status":
            found = report.status(args.dir)
            print(json.dumps(found, indent=1) if args.json else report.format_report(found))
        elif args.action == "check":
            found = kernels.check(args.dir, seats=args.seat or None, rounds=args.rounds, timeout=args.timeout)
            print(kernels.format_check(found))
            return 1 if found["failed"] else 0
        elif args.action == "collect":
            def done(name, result):
                print(_graded_line(name, result), flush=True)

            out = collect.collect(args.dir, args.out, gradescope=args.gradescope, exercises=args.exercises or None,
                                  jobs=args.jobs, timeout=args.timeout, on_seat=done)
            print(f"graded {len(out['learners'])} seats in {out['time_s']:.1f} s (seed {out['seed']}): grades in "
                  f"{out['csv']}, each seat's results in {out['results_dir']}/"
                  + (f", Gradescope results.json in {args.gradescope}/<seat>/" if args.gradescope else ""))
            return _say_not_graded(out["not_graded"], "seat")
        elif args.action == "remove-users":
            removed = hub.remove_users(args.dir)
            print(f"removed {len(removed)} seat user(s){': ' + ', '.join(removed) if removed else ''}; every seat's "
                  f"files are kept, now the instructor's." if removed else
                  "no seat of this workshop has a Unix user of its own; nothing removed.")
        else:
            print(hub.format_stopped(hub.stop(args.dir), args.dir))
    except WorkshopError as e:
        raise UsageError(str(e)) from None
    return 0


def add_commands(sub) -> None:
    """This group's subcommands, on the ``gpucourse`` parser's ``sub``."""
    p = sub.add_parser("lab", help="open the course in JupyterLab (what 'make lab' runs)",
                       description="Serve notebooks/ with JupyterLab on 127.0.0.1, behind a token.")
    p.add_argument("--port", type=whole(0, 65535, why="a port number; 0 picks a free one"), default=8888,
                   help="port (default 8888; Jupyter takes the next free one if it is busy; 0 picks any free port)")
    p.set_defaults(func=cmd_lab)

    p = sub.add_parser("fetch-course", help="copy the notebooks and exercises out of an installed course",
                       description="Copy the course's notebooks and exercise stubs into DIR (made if missing), "
                                   "from the installed wheel (make dist) or the checkout; nothing is overwritten.")
    p.add_argument("folder", metavar="DIR", help="an empty or new folder to work in")
    p.set_defaults(func=cmd_fetch_course)

    from ..grading.runner import DEFAULT_MEMORY_GB, DEFAULT_TIMEOUT_S

    p = sub.add_parser("grade", help="grade the exercises: each check, its hint, the score",
                       description="Grade exercises/ (or --path DIR), or a whole class (--class DIR). "
                                   "Exit status: 0 when every check passed (or a class was graded), 1 otherwise, "
                                   "3 when the grader itself could not run (no grade given: not the learner's code).")
    p.add_argument("exercises", nargs="*", metavar="EXERCISE", help="which ones (ex03, or 3); default all")
    p.add_argument("--path", metavar="DIR",
                   help="folder to grade (default: exercises/ here or above, else the repository's; only that "
                        "default records the scores in your progress file)")
    p.add_argument("--json", metavar="FILE", help="also write the results in Gradescope's results.json format")
    p.add_argument("--class", dest="class_dir", metavar="DIR",
                   help="grade every learner folder in DIR (one sub-folder per learner)")
    p.add_argument("--out", metavar="FILE.csv",
                   help="with --class: one row per learner, one column per exercise, and the total; each "
                        "learner's results JSON goes to FILE-results/")
    p.add_argument("--jobs", type=POSITIVE, default=1, help="with --class: learners graded at a time (default 1)")
    p.add_argument("--timeout", type=POSITIVE_NUMBER, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds each check's code may take on a quiet machine (default {DEFAULT_TIMEOUT_S:g}); "
                        f"scaled up by how loaded the machine is, and starting ranks is not counted")
    p.add_argument("--memory-gb", type=POSITIVE_NUMBER, default=DEFAULT_MEMORY_GB, metavar="G",
                   help=f"address space each exercise's processes may use (default {DEFAULT_MEMORY_GB:g} GiB)")
    p.add_argument("--seed", type=SEED, default=None,
                   help="seed of the checks' random inputs (default: fresh each run; failures print it)")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("quiz", help="exam-style questions with explanations; a timed mock exam",
                       description="Ask questions in the terminal, say at once whether each answer is right and "
                                   "why, and record the score (see 'gpucourse progress'). Topics: "
                                   "distributed-setups, parallelism, memory-batch, profiling-troubleshooting.")
    from ..quiz import TOPICS

    p.add_argument("--topic", type=Name(TOPICS), default=None, help="one topic (default: all)")
    p.add_argument("--count", type=POSITIVE, default=None, help="questions to ask (default 10; 40 with --exam)")
    p.add_argument("--seed", type=SEED, default=None, help="draw the same questions again")
    p.add_argument("--exam", action="store_true",
                   help="a mock exam across all topics, timed (90 s a question), marked at the end")
    p.add_argument("--export", metavar="FILE",
                   help="write the whole bank (or --topic's questions) as JSON, with answers and explanations")
    p.add_argument("--review", action="store_true",
                   help="ask again the questions you missed, spaced over sessions (Leitner boxes): a missed question "
                        "comes back next session; each right answer moves it up a box, and boxes 1-5 wait 1, 2, 4, "
                        "8, 16 sessions (a session is one finished quiz, review or mock exam)")
    p.set_defaults(func=cmd_quiz)

    p = sub.add_parser("progress", help="exercises passed and quiz scores so far",
                       description="Read the progress file (~/.gpucourse/progress.json, or $GPUCOURSE_PROGRESS) "
                                   "that 'gpucourse grade' and the quizzes write.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--reset", action="store_true", help="forget all progress (removes the file)")
    p.set_defaults(func=cmd_progress)

    from ..workshop.hub import DEFAULT_PORT

    p = sub.add_parser("workshop", help="run the course for a class: JupyterHub seats, a dashboard, grading",
                       description="A JupyterHub on this machine with one seat per learner: its own copy of the "
                                   "course, progress file and GPUs (or, with --spawner slurm, its own SLURM job). "
                                   "The workshop lives in --dir (default "
                                   "~/.gpucourse/workshop, or $GPUCOURSE_WORKSHOP).")
    actions = p.add_subparsers(dest="action", required=True)
    w = actions.add_parser("start", help="start (or resume) the hub and every seat's JupyterLab")
    w.add_argument("--seats", type=POSITIVE, default=None,
                   help="learners (a new workshop needs it; resuming keeps them)")
    w.add_argument("--gpus-per-seat", type=NON_NEGATIVE, default=None, metavar="K",
                   help="GPUs for each seat (default: the visible GPUs shared evenly; 0: CPU seats)")
    w.add_argument("--port", type=whole(1, 65535), default=None,
                   help=f"the hub's port (default {DEFAULT_PORT}; resuming keeps the last start's)")
    w.add_argument("--public", action=argparse.BooleanOptionalAction, default=None,
                   help="listen on every interface, not only 127.0.0.1 (resuming keeps the last start's; "
                        "--no-public: 127.0.0.1 only again)")
    w.add_argument("--password", action="store_true",
                   help="one workshop password for every seat instead of a code per seat")
    w.add_argument("--users", metavar="NAME[,NAME...]",
                   help="real accounts of this machine as the seats (PAM login, servers run as them; needs root)")
    w.add_argument("--admin", metavar="NAME", help="with --users: the instructor's account (default: yours)")
    w.add_argument("--new-codes", action="store_true", help="new codes (or password) instead of the same ones")
    w.add_argument("--spawner", choices=("local", "slurm"), default=None,
                   help="where each seat's JupyterLab runs: local, a process on this machine (the default), or "
                        "slurm, a batch job on the SLURM cluster this machine submits to (resuming keeps the last)")
    w.add_argument("--partition", metavar="NAME", help="with --spawner slurm: the seats' partition (default: the "
                                                       "cluster's default)")
    w.add_argument("--gres", metavar="SPEC", help="with --spawner slurm: each seat's generic resources, e.g. gpu:1 "
                                                  "or a MIG profile gpu:1g.10gb:1 (default: none, CPU nodes)")
    w.add_argument("--time", metavar="LIMIT", help="with --spawner slurm: each seat's time limit, minutes, HH:MM:SS or "
                                                   "D-HH:MM:SS (default: the partition's)")
    w = actions.add_parser("status", help="each seat's progress, what to explain next, GPU use")
    w.add_argument("--json", action="store_true", help="print JSON")
    w = actions.add_parser("check", help="open a notebook in every seat at once and run a cell: do the kernels work?",
                           description="What a class does at 9:00, done before it: a kernel in every seat (or "
                                       "those named), all started in the same moment through the hub, each running "
                                       "one cell, then shut down. Exit status 1 when a seat failed; its server's "
                                       "log is printed.")
    w.add_argument("seat", nargs="*", help="which seats (default: all)")
    w.add_argument("--rounds", type=POSITIVE, default=1, help="how many times (default 1)")
    w.add_argument("--timeout", type=POSITIVE_NUMBER, default=None, metavar="S",
                   help="seconds for each seat's kernel to start and run the cell (default 120)")
    w = actions.add_parser("collect", help="grade every seat's exercises into one CSV",
                           description="Grade every seat's exercises/ into one CSV. Exit status 3 when the grader "
                                       "could not run for some seat: each such seat and exercise is named on "
                                       "stderr, and gets no grade (an empty cell).")
    w.add_argument("exercises", nargs="*", metavar="EXERCISE", help="which ones (ex03, or 3); default all")
    w.add_argument("--out", default="grades.csv", metavar="FILE.csv",
                   help="one row per seat (default grades.csv); each seat's results JSON goes to FILE-results/")
    w.add_argument("--gradescope", metavar="DIR", help="also write DIR/<seat>/results.json for Gradescope")
    w.add_argument("--jobs", type=POSITIVE, default=None,
                   help="seats graded at a time (default: cores ÷ 4, at least 1)")
    w.add_argument("--timeout", type=POSITIVE_NUMBER, default=None, metavar="S",
                   help="seconds per check (as grade --timeout)")
    actions.add_parser("stop", help="stop the hub and every seat's server; keep every seat's work")
    actions.add_parser("remove-users", help="remove the seats' Unix users of a stopped workshop (as root); keep "
                                            "every seat's files")
    for w in actions.choices.values():
        w.add_argument("--dir", default=None, help="the workshop's folder")
    p.set_defaults(func=cmd_workshop)
