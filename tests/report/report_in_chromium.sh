#!/bin/bash
# ctest report.page_in_headless_chromium: `epx report` of an EP-overlap A/B (2 ranks, with
# traces) is one self-contained file that loads in headless Chromium without errors and draws
# every plot; the screenshot is kept as report.png beside the test's output when EPX_KEEP_REPORT
# names a folder. Exit 77 (skipped) without chromium. The plotting library it inlines is an input:
# never overwritten by -o, and refused when it is not plotly.js.
# Usage: report_in_chromium.sh MPIRUN EPX
set -euo pipefail
mpirun=$1 epx=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for overlap in false true; do
  "$mpirun" --oversubscribe -np 2 "$epx" run qwen3_30b_a3b_proxy model.vocab_size=1024 train.global_batch_size=8 \
    --moe_a2a_overlap $overlap --max_steps 4 --results "$dir/overlap_$overlap.json" \
    --trace "$dir/overlap_$overlap.trace.json" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
done
"$epx" report "$dir/overlap_false.json:$dir/overlap_false.trace.json" "$dir/overlap_true.json:$dir/overlap_true.trace.json" \
  -o "$dir/report.html"
# The plotting library is an input: never the output, and refused when it is not plotly.js.
mkdir "$dir/vendor"
echo 'not plotly' >"$dir/vendor/plotly-basic.min.js"
for out in "$dir/vendor/plotly-basic.min.js" "$dir/other.html"; do
  if EPX_VENDOR_DIR="$dir/vendor" "$epx" report "$dir/overlap_true.json" -o "$out" 2>"$dir/err"; then
    echo "a report over or with a broken plotting library was written"; exit 1
  fi
  grep -Eq 'the same file as the plotting library|not the plotting library' "$dir/err" || { cat "$dir/err"; exit 1; }
done
[[ ! -e $dir/other.html && $(cat "$dir/vendor/plotly-basic.min.js") == 'not plotly' ]]
browser=$(command -v chromium || command -v chromium-browser || true)
[[ -n $browser ]] || { echo "skipped: no chromium (scripts/test.sh installs it)"; exit 77; }
# Self-contained: nothing fetched at view time.
if grep -Eq '<script[^>]* src=|<link[^>]* href=|@import' "$dir/report.html"; then
  echo "the page loads something from outside"; exit 1
fi
chrome=("$browser" --headless=new --no-sandbox --disable-gpu --virtual-time-budget=10000 --window-size=1400,3600)
"${chrome[@]}" --enable-logging=stderr --v=0 --screenshot="$dir/report.png" "file://$dir/report.html" 2>"$dir/console.txt" >/dev/null
"${chrome[@]}" --dump-dom "file://$dir/report.html" 2>/dev/null >"$dir/dom.html"
status=$(grep -o 'data-status="[^"]*"' "$dir/dom.html" | head -1)
plots=$(grep -o 'class="main-svg"' "$dir/dom.html" | wc -l)
echo "page: $status, $plots plot layers, screenshot $(stat -c %s "$dir/report.png") bytes"
if grep -E 'CONSOLE' "$dir/console.txt" | grep -Eiq 'error|uncaught'; then
  grep CONSOLE "$dir/console.txt"; exit 1
fi
[[ $status == 'data-status="ok"' ]]
# step, loss, memory, the walls and two timelines: each plot draws two SVG layers.
((plots >= 12))
(($(stat -c %s "$dir/report.png") > 50000))
if [[ -n ${EPX_KEEP_REPORT:-} ]]; then cp "$dir/report.html" "$dir/report.png" "$EPX_KEEP_REPORT/"; fi
echo "report.page_in_headless_chromium: passed"
