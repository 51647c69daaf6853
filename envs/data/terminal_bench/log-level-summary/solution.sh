#!/bin/bash
cat logs/*.log | awk '{ print $2 }' | sort | uniq -c | awk '{ print $2, $1 }' \
  | sort -k2,2nr -k1,1 > summary.txt
