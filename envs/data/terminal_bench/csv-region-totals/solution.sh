#!/bin/bash
{
  echo "region,total"
  tail -n +2 sales.csv | awk -F, '{ s[$1] += $2 } END { for (r in s) print r "," s[r] }' | sort
} > totals.csv
