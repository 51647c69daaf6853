#!/bin/bash
cat > count_lines.sh <<'SCRIPT'
#!/bin/bash
# Prints the total number of lines of the .txt files in directory $1.
total=0
for f in "$1"/*.txt; do
  [ -f "$f" ] || continue
  n=$(wc -l < "$f")
  total=$((total + n))
done
echo "$total"
SCRIPT
chmod +x count_lines.sh
