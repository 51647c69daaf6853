#!/bin/bash
# The agent's starting state: a line counter with two bugs, and sample data.
set -e
cat > count_lines.sh <<'SCRIPT'
#!/bin/bash
# Prints the total number of lines of the .txt files in directory $1.
total=0
for f in $1/*.txt; do
  n=$(wc -l $f)
  total=$((total + n))
done
echo $totl
SCRIPT
chmod +x count_lines.sh
mkdir -p notes
printf 'a\nb\nc\n' > notes/one.txt
printf 'd\ne\n' > notes/two.txt
printf 'ignored\n' > notes/three.md
