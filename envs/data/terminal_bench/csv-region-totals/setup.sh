#!/bin/bash
set -e
cat > sales.csv <<'CSV'
region,amount
north,120
south,75
east,300
north,30
west,5
south,25
east,-100
north,1
CSV
