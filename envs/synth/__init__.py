"""Synthesis of SWE-style bug-fixing instances from a repository and its tests (SWE-smith style).

    report = synthesize("path/to/repo_or_sdist.tar.gz", "python3 -m pytest -q tests", "out/",
                        name="me/calc", max_per_kind=20, workers=2)   # or a SynthConfig
    print(summary(report))                                 # rows in out/tasks.jsonl
    tasks = envs.tasks.load_swe_jsonl("out/tasks.jsonl")   # rows without repo_path load
                                                           # from out/mirror, found beside them

    python -m envs.synth --repo DIR_OR_TGZ --test_command "python3 -m pytest -q tests" \\
        --out DIR [--name owner/name --kinds K,... --max_per_kind N --max_instances N --runs 3 \\
        --workers 2 --commits REV,... --statements template|teacher --teacher_url URL \\
        --teacher_model M --seed 0 --log_parser P --hide_tests --no_trees \\
        --environment none|repository]

The source is a local git repository (its HEAD commit), or a directory or .tar.gz of an
unpacked source distribution with its tests. Every test run happens in a FRESH sandbox (bwrap by
default) under the verifier's trusted runners (`envs.verifiers.swe`). The test command is
pytest, `python3 -m unittest ...` (its verbose log read by swebench's `parse_log_django`), or
a runner script of the repository whose log a named swebench parser reads (`envs.synth.runs`:
e.g. `--log_parser parse_log_django` for a script running unittest verbosely).
1. Baseline: the whole suite runs `runs` times. Tests that pass in every run are the candidate
   tests; tests whose outcome differs between runs are flaky (dropped and listed in the report);
   tests that always fail or skip are ignored.
2. Candidates: `envs.mutate.mutations` over the non-test .py files (per kind, a seeded sample of
   at most `max_per_kind`), plus `envs.mutate.commit_reverts` of chosen commits of a git
   repository (kind "revert": one instance per changed function of a commit, used when the
   file at that commit is still HEAD's). The runner script's files are never mutated.
3. Each candidate's suite runs with the mutated file. It is kept when at least one candidate
   test fails or errors (FAIL_TO_PASS), every other candidate test still passes (PASS_TO_PASS),
   no more than `max_fail_fraction` of the candidate tests fail (more is an import error, not a
   bug), and a second run gives the same FAIL_TO_PASS set. Each rejection records its reason:
   no_failures (the suite does not notice the change), too_many_failures, other_tests_changed
   (a candidate test skipped or xfailed), mutated_test_module (a failing test lives in the
   mutated file), crashed (the run gave no trustworthy result), timeout, unstable (the second
   run disagrees). A sandbox that fails to start leaves the candidate for the next run.
4. Instances are SWE-bench rows in `OUT/tasks.jsonl` (`envs.synth.rows`), their repository a
   git mirror `OUT/mirror/<owner>__<name>.git` that synthesis writes with git plumbing: branch
   `main` the clean source, one branch per instance named after its `instance_id`, whose
   commit plants the bug. Fields:
     instance_id, repo ("owner/name"; default "local/<package>"), base_commit (the bug
     commit; its parent is the clean commit), patch (the FIX: bug -> clean), test_patch,
     problem_statement, hints_text (""), created_at (the source commit's date; for other
     sources the baseline's time), version, FAIL_TO_PASS and PASS_TO_PASS (JSON strings of
     test ids: pytest node ids, or the log parser's names), environment_setup_commit (the
     clean commit), test_command (pytest's with "-rA"), log_parser (swebench's parser name),
     timeout, problem_statements (three phrasings), difficulty, mutation {kind, description,
     path, function, lineno}, source {package, version, commit (git)}, statement_source;
     environment (with `environment="repository"`: the spec `envs.environments` reads from the
     repository's metadata, built before the baseline so that every run of the synthesis
     starts from it, as the rows' runs will); repo_path (`trees`, the default: the tree of
     base_commit at OUT/repos/<instance_id>, every unchanged file hard-linked to the clean
     copy OUT/base; read-only data, sandboxes get copies).
   Tests: by default the agent's tree keeps every test and `test_patch` is "": the tests
   exist before the bug, as in the repository's history, and the statements name them. With
   `hide_tests` the bug commit also removes the files of the FAIL_TO_PASS tests (SWE-smith's
   "Remove F2P Tests") and `test_patch` puts them back, as SWE-bench applies a test patch only
   for grading; `git diff base_commit environment_setup_commit` is then patch + test_patch.
   The test command always runs the whole suite (PASS_TO_PASS spans every test file).
5. Problem statements never show the patch (`envs.synth.statements`): "template" (the failing
   tests and their messages, three phrasings) or "teacher" (an OpenAI-compatible endpoint,
   replies that leak the fix rejected).
6. `OUT/report.json`: candidates, validated instances and yield per mutation kind, rejection
   reasons, flaky tests, sandbox runs and time.

Resumable: `OUT/baseline.json` keeps the baseline and `OUT/journal.jsonl` one line per finished
candidate; a rerun with the same source reuses both and runs only unfinished candidates (the
mirror and rows are rewritten from the journal, to the same commit ids and bytes). Rows of
earlier versions (a `repo_path` tree, lists of test ids, `base_commit` the source's HEAD) stay
loadable by `envs.tasks`.

Difficulty (`difficulty`), from the fix's changed lines L (added + removed) and the number F of
FAIL_TO_PASS tests: "easy" when L <= 2 and F >= 3 (a small fix that many tests point at),
"hard" when L >= 6, or F == 1 and L >= 3 (a larger fix with little signal), else "medium".
"""

from envs.synth.candidates import REVERT, candidate_key, difficulty, draw_candidates, \
    mutable_paths
from envs.synth.core import DIFFICULTIES, ENVIRONMENTS, STATEMENTS, SynthConfig, main, summary, \
    synthesize, synthesize_async
from envs.synth.mirror import MirrorWriter
from envs.synth.rows import MAIN, mirror_dir
from envs.synth.runs import SandboxMaker, TestCommand, node_statuses, parse_test_command, \
    run_suite, test_file
from envs.synth.source import SOURCE_EPOCH, Source, SynthError, digest, load_source
from envs.synth.statements import _TEACHER_STYLES, Teacher, failure_messages, function_source, \
    leak_reason, module_name, patch_lines, problem_statements, teacher_reply, \
    teacher_statements, template_statements

__all__ = [
    "DIFFICULTIES", "ENVIRONMENTS", "MAIN", "REVERT", "SOURCE_EPOCH", "STATEMENTS", "MirrorWriter",
    "SandboxMaker", "Source", "SynthConfig", "SynthError", "Teacher", "TestCommand",
    "candidate_key", "difficulty", "digest", "draw_candidates", "failure_messages",
    "function_source", "leak_reason", "load_source", "main", "mirror_dir", "module_name",
    "mutable_paths", "node_statuses", "parse_test_command", "patch_lines", "problem_statements",
    "run_suite", "summary", "synthesize", "synthesize_async", "teacher_reply",
    "teacher_statements", "template_statements", "test_file",
]
