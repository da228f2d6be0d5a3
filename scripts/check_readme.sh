#!/usr/bin/env bash
# Run README.md's CPU commands, in order, as a newcomer would paste them into a fresh clone,
# at the smallest sizes the commands allow; fail on the first command that fails.
#
#   bash scripts/check_readme.sh          # CI runs it after `make test` (.ci/run)
#   bash scripts/check_readme.sh --head   # check HEAD only, without uncommitted changes
#   bash scripts/check_readme.sh --list   # print the commands it would run (shrunk), run none
#
# What it does:
# - Takes the ```bash and ```python fenced blocks of README.md in order. A block whose previous
#   non-blank line is `<!-- readme-check: skip: REASON -->` is skipped (GPU, TensorRT, nsys, pip
#   extras, the hours-long training, a running server); every other bash block is run, one
#   logical line (`\` joins lines) at a time, and every other python block as one script
#   (`.venv/bin/python FILE`).
# - Runs them in a fresh temporary folder holding `git clone -q` of this repository plus, unless
#   --head is given, the working tree's uncommitted changes and untracked (not ignored) files:
#   it checks the README and code as they are now; on CI (a clean checkout) that is HEAD.
#   `.venv` there is a symlink to this repository's own `.venv` (built by `make test`), and
#   PYTHONPATH is the clone, so the code that runs is the clone's, as it would be in a fresh
#   clone whose .venv has it installed editable. The README's first block is handled apart, so
#   that make never reinstalls into the shared .venv: `make test` is skipped (CI ran it just
#   before), `make demo` runs the commands of the Makefile's demo target (`make -n`), shrunk.
# - LANTERN_CACHE is a fresh temporary folder, so the first-use export is exercised (once).
# - Before running a `.venv/bin/lantern` or `.venv/bin/python -m lantern_rt...` command it
#   shrinks sizes with the two tables below, strips its trailing `# comment` and prints it
#   (`+ cmd`). Commands run in this shell with `eval`, so variables and `cd` carry over from one
#   to the next as in a terminal. The first failing command is printed and the script exits 1.
# - Every block, skipped or not, must call lantern, python and pip through `.venv/bin/`.
# Needs the dataset-fashion-mnist apt package (the README's bench and training use it).
set -euo pipefail

# Options rewritten to the smallest value the command allows: "OPTION VALUE".
SHRINK=(
  "-n 1"           # lantern generate / bench: images per class
  "--num-images 1" # the same, long form (make demo)
  "--samples 1"    # lantern calibrate: calibration images per pipeline
  "--validate 1"   # lantern calibrate: images per validation run
  "--steps 2"      # lantern train-drafter
  "--epochs 1"     # python -m lantern_rt.eval.classifier
)
# Options appended where a command lacks them: "COMMAND-REGEX => OPTION-REGEX => APPENDED".
# @SMALL_DATA@: the first 1024 training and 256 test images of Fashion-MNIST (one epoch of the
# full set takes minutes; --data is the only size the classifier's training has besides epochs).
ADD=(
  "^\.venv/bin/lantern (generate|bench)( |$) => (-n|--num-images) => -n 1"
  "^\.venv/bin/lantern calibrate( |$) => --validate => --validate 1"
  "^\.venv/bin/python -m lantern_rt\.eval\.classifier( |$) => --data => --data @SMALL_DATA@"
)
FASHION_MNIST=/usr/share/datasets/fashion-mnist

RC_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RC_HEAD_ONLY=0 RC_LIST=0
for rc_arg in "$@"; do
  case "$rc_arg" in
    --head) RC_HEAD_ONLY=1 ;;
    --list) RC_LIST=1 ;;
    *) echo "usage: $0 [--head] [--list]" >&2; exit 2 ;;
  esac
done

# Patterns of this script (in variables: bash reads them literally there).
RC_FENCE_BASH='^```bash[[:space:]]*$'
RC_FENCE_PYTHON='^```python[[:space:]]*$'
RC_FENCE_OPEN='^```'
RC_FENCE_CLOSE='^```[[:space:]]*$'
RC_MARKER='^<!-- readme-check: skip: (.*[^[:space:]]) -->$'
RC_NOT_A_COMMAND='^[[:space:]]*(#|$)'
RC_SHRINKABLE='^\.venv/bin/(lantern|python -m lantern_rt)([.[:space:]]|$)'
RC_BARE='(^|[[:space:];&|(])(lantern|python3?|pip3?)([[:space:]]|$)'
RC_MAKE='^make([[:space:]]|$)'

rc_die() { echo "readme-check: $*" >&2; exit 1; }

[ -x "$RC_REPO/.venv/bin/lantern" ] || rc_die "no $RC_REPO/.venv/bin/lantern: run 'make test' first"
[ -f "$FASHION_MNIST/train-images-idx3-ubyte.gz" ] ||
  rc_die "$FASHION_MNIST is missing: sudo apt-get install dataset-fashion-mnist"

RC_START=$SECONDS
RC_WORK=$(mktemp -d "${TMPDIR:-/tmp}/readme-check.XXXXXX")
trap 'cd /; rm -rf "$RC_WORK"' EXIT
RC_CLONE=$RC_WORK/clone
RC_SMALL_DATA=$RC_WORK/fashion-mnist-small

# --- the README's bash and python blocks ----------------------------------------------------
# RC_BLOCK_SKIP[i]: the skip reason ("" = run); RC_BLOCK_LINE[i]: README line of the fence;
# RC_BLOCK_CMDS[i]: its logical command lines, newline-separated (comments and blanks dropped),
# each as "README-LINE<tab>COMMAND" (a python block: one command running the block's file).
RC_BLOCK_SKIP=() RC_BLOCK_LINE=() RC_BLOCK_CMDS=()
rc_parse() {
  local line n=0 in_fence="" marker="" marker_line=0 cmds="" pending="" start=0 script=""
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    if [ -n "$in_fence" ]; then
      if [[ $line =~ $RC_FENCE_CLOSE ]]; then
        [ -z "$pending" ] || rc_die "README.md:$n: a block ends in a '\\' continuation"
        if [ "$in_fence" = bash ]; then RC_BLOCK_CMDS+=("$cmds"); fi
        if [ "$in_fence" = python ]; then RC_BLOCK_CMDS+=("${RC_BLOCK_LINE[-1]}"$'\t'".venv/bin/python $script"$'\n'); fi
        in_fence="" cmds=""
      elif [ "$in_fence" = python ]; then
        printf '%s\n' "$line" >>"$script"
      elif [ "$in_fence" = bash ]; then
        [ -n "$pending" ] || start=$n
        if [[ $line == *\\ ]]; then
          pending+="${line%\\} "
          continue
        fi
        line="$pending$line" pending=""
        [[ $line =~ $RC_NOT_A_COMMAND ]] || cmds+="$start"$'\t'"$line"$'\n'
      fi
      continue
    fi
    if [[ $line =~ $RC_FENCE_BASH || $line =~ $RC_FENCE_PYTHON ]]; then
      in_fence=bash
      if [[ $line =~ $RC_FENCE_PYTHON ]]; then
        in_fence=python script=$RC_WORK/readme-line-$n.py
        : >"$script"
      fi
      RC_BLOCK_LINE+=("$n")
      if [ -n "$marker" ]; then RC_BLOCK_SKIP+=("$marker"); else RC_BLOCK_SKIP+=(""); fi
      marker=""
    elif [[ $line =~ $RC_FENCE_OPEN ]]; then
      in_fence=other
      [ -z "$marker" ] || rc_die "README.md:$marker_line: the skip marker is not followed by a bash or python block"
    elif [[ $line =~ $RC_MARKER ]]; then
      marker=${BASH_REMATCH[1]} marker_line=$n
    elif [[ $line == '<!--'*readme-check* ]]; then
      rc_die "README.md:$n: malformed marker (expected '<!-- readme-check: skip: REASON -->')"
    elif [[ -n $marker && $line =~ [^[:space:]] ]]; then
      rc_die "README.md:$marker_line: the skip marker is not followed by a bash or python block"
    fi
  done <"$1"
  [ -z "$in_fence" ] || rc_die "README.md: unterminated code block"
  [ -z "$marker" ] || rc_die "README.md:$marker_line: the skip marker is not followed by a bash or python block"
}

# --- rewriting --------------------------------------------------------------------------------
rc_strip_comment() { # drop a trailing "  # comment" (a '#' outside quotes, after a blank)
  local s=$1 out="" c quote="" i
  for ((i = 0; i < ${#s}; i++)); do
    c=${s:i:1}
    if [ -n "$quote" ]; then
      [ "$c" != "$quote" ] || quote=""
    elif [ "$c" = "'" ] || [ "$c" = '"' ]; then
      quote=$c
    elif [ "$c" = "#" ] && [[ -z $out || $out =~ [[:space:]]$ ]]; then
      break
    fi
    out+=$c
  done
  printf '%s\n' "${out%"${out##*[![:space:]]}"}"
}

rc_shrink() {
  local cmd=$1 entry opt val cmd_re opt_re add
  if [[ $cmd =~ $RC_SHRINKABLE ]]; then
    for entry in "${SHRINK[@]}"; do
      opt=${entry%% *} val=${entry#* }
      cmd=$(sed -E "s/(^|[[:space:]])(${opt})([[:space:]]+|=)[^[:space:]]+/\\1\\2\\3${val}/g" <<<"$cmd")
    done
    for entry in "${ADD[@]}"; do
      cmd_re=${entry%% => *} add=${entry##* => } opt_re=${entry#* => } opt_re=${opt_re%% => *}
      opt_re="(^|[[:space:]])$opt_re([[:space:]]|=|$)"
      if [[ $cmd =~ $cmd_re ]] && ! [[ $cmd =~ $opt_re ]]; then
        cmd+=" ${add//@SMALL_DATA@/$RC_SMALL_DATA}"
      fi
    done
  fi
  printf '%s\n' "$cmd"
}

rc_lint() { # every block: lantern, python and pip through .venv/bin/
  local i at cmd
  for i in "${!RC_BLOCK_CMDS[@]}"; do
    while IFS=$'\t' read -r at cmd; do
      [ -n "$at" ] || continue
      cmd=$(rc_strip_comment "$cmd")
      if [[ $cmd =~ $RC_BARE ]]; then
        rc_die "README.md:$at: '${BASH_REMATCH[2]}' without the .venv/bin/ prefix: $cmd"
      fi
    done <<<"${RC_BLOCK_CMDS[i]}"
  done
}

# --- running ----------------------------------------------------------------------------------
RC_PASSED=0
rc_run() { # $1: README line, $2: command as written in the README
  local rc_cmd rc_status=0 rc_t0=$SECONDS
  rc_cmd=$(rc_shrink "$(rc_strip_comment "$2")")
  echo "+ $rc_cmd"
  if [ "$RC_LIST" = 1 ]; then RC_PASSED=$((RC_PASSED + 1)); return 0; fi
  eval "$rc_cmd" </dev/null || rc_status=$?
  if [ "$rc_status" -ne 0 ]; then
    echo "readme-check: FAILED (exit $rc_status), README.md line $1:" >&2
    echo "  $rc_cmd" >&2
    [ "$rc_cmd" = "$2" ] || echo "  (as written: $2)" >&2
    exit 1
  fi
  echo "readme-check: ok ($((SECONDS - rc_t0)) s)"
  RC_PASSED=$((RC_PASSED + 1))
}

rc_make() { # the README's make commands, without make touching .venv
  local at=$1 target=${2#make } line
  target=$(rc_strip_comment "$target")
  case "$target" in
    test) echo "+ make test: skipped (CI ran it just before; it would reinstall into .venv if stale)" ;;
    demo)
      echo "+ make demo: the commands of its recipe (make -n), shrunk:"
      while IFS= read -r line; do
        [ -z "$line" ] || rc_run "$at" "$line"
      done < <(make --no-print-directory -s -n -o .venv/.installed demo </dev/null)
      ;;
    *) rc_die "README.md:$at: don't know how to check 'make $target' without make reinstalling .venv" ;;
  esac
}

# --- the clone ----------------------------------------------------------------------------------
git clone -q "$RC_REPO" "$RC_CLONE"
if [ "$RC_HEAD_ONLY" = 0 ]; then
  (
    cd "$RC_REPO"
    {
      git diff -z --name-only --no-renames --diff-filter=d HEAD
      git ls-files -z --others --exclude-standard
    } | xargs -0 -r cp -a --parents -t "$RC_CLONE"
    git diff -z --name-only --no-renames --diff-filter=D HEAD | (cd "$RC_CLONE" && xargs -0 -r rm -f)
  )
fi
if [ -e "$RC_CLONE/.venv" ] || [ -L "$RC_CLONE/.venv" ]; then
  rc_die ".venv is among the repository's files: it must be ignored"
fi
ln -s "$RC_REPO/.venv" "$RC_CLONE/.venv"
"$RC_REPO/.venv/bin/python" - "$FASHION_MNIST" "$RC_SMALL_DATA" <<'EOF'
import gzip, sys
from pathlib import Path

src, dst = map(Path, sys.argv[1:])
dst.mkdir()
for split, count in (("train", 1024), ("t10k", 256)):
    for kind, header, size in (("images-idx3-ubyte", 16, 28 * 28), ("labels-idx1-ubyte", 8, 1)):
        raw = gzip.decompress((src / f"{split}-{kind}.gz").read_bytes())
        head = raw[:4] + count.to_bytes(4, "big") + raw[8:header]
        (dst / f"{split}-{kind}.gz").write_bytes(gzip.compress(head + raw[header : header + count * size]))
EOF

rc_parse "$RC_CLONE/README.md"
rc_lint

mkdir "$RC_WORK/cache"
export LANTERN_CACHE=$RC_WORK/cache
export PYTHONPATH=$RC_CLONE${PYTHONPATH:+:$PYTHONPATH}
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-30} # progress bars, but a few lines in a CI log
echo "readme-check: README.md in $RC_CLONE, LANTERN_CACHE=$LANTERN_CACHE"
cd "$RC_CLONE"

RC_SKIPPED=0
for RC_I in "${!RC_BLOCK_CMDS[@]}"; do
  if [ -n "${RC_BLOCK_SKIP[RC_I]}" ]; then
    echo "readme-check: skip the block at README.md line ${RC_BLOCK_LINE[RC_I]}: ${RC_BLOCK_SKIP[RC_I]}"
    RC_SKIPPED=$((RC_SKIPPED + 1))
    continue
  fi
  while IFS=$'\t' read -r RC_AT RC_CMD; do
    [ -n "$RC_AT" ] || continue
    if [[ $RC_CMD =~ $RC_MAKE ]]; then
      rc_make "$RC_AT" "$RC_CMD"
    else
      rc_run "$RC_AT" "$RC_CMD"
    fi
  done <<<"${RC_BLOCK_CMDS[RC_I]}"
done

if [ "$RC_LIST" = 1 ]; then RC_VERB="listed (--list: none run)"; else RC_VERB=passed; fi
echo "readme-check: $RC_PASSED commands $RC_VERB, $RC_SKIPPED blocks skipped ($((SECONDS - RC_START)) s)"
