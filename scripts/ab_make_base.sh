#!/usr/bin/env bash
# Fills an A/B variant directory for scripts/ab_bench.sh from a git revision, on this machine: every file
# under csrc/ and jaxquant/ that differs between REV and the working tree, as it is at REV (flat, named
# as ab_bench.sh expects). Pass the directory to the device call with carry (ab/ is git-ignored).
#   bash scripts/ab_make_base.sh 31e1fef            # -> ab/base
#   bash scripts/ab_make_base.sh HEAD~2 ab/older
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: ab_make_base.sh REV [DIR]} dir=${2:-ab/base}
rm -rf "$dir" && mkdir -p "$dir"
changed=$(git diff --name-only "$rev" -- csrc jaxquant)
[ -n "$changed" ] || { echo "no file under csrc/ or jaxquant/ differs from $rev" >&2; exit 1; }
for f in $changed; do
  name=$(basename "$f")
  # ab_bench.sh finds each file by its name: a name used twice under csrc/ and jaxquant/ would be ambiguous
  [ "$(find csrc jaxquant -name "$name" | wc -l)" -le 1 ] || { echo "$f: name not unique" >&2; exit 1; }
  if git cat-file -e "$rev:$f" 2> /dev/null; then
    git show "$rev:$f" > "$dir/$name"
  else
    echo "$f: not in $rev (new since); ab_bench.sh cannot remove it, skipped" >&2
  fi
done
ls "$dir"
