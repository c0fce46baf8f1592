#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in crct10dif_common crc-t10dif crc64 crc64-rocksoft t10-pi nvme-core nvme; do
    insmod /lib/modules/$m.ko 2>/dev/null
done
i=0
while [ ! -b /dev/nvme0n1 ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
now() { cut -d' ' -f1 /proc/uptime; }
run() { # name bs count dd-args...
    name=$1; bs=$2; n=$3; shift 3
    t0=$(now); dd bs=$bs count=$n "$@" 2>/dev/null; t1=$(now)
    echo "BENCH $name $bs $n $t0 $t1" | awk '{d=$6-$5; if (d<=0) d=0.01; printf "BENCH %s bs=%s ios=%d s=%.2f iops=%.0f MBps=%.1f\n", $2, $3, $4, d, $4/d, $4*($3+0)/d/1e6}'
}
for rep in 1 2 3; do
    run seq4k-qd1-read 4096 2000 if=/dev/nvme0n1 of=/dev/null iflag=direct skip=100
    run seq128k-read 131072 400 if=/dev/nvme0n1 of=/dev/null iflag=direct
    run seq128k-write 131072 400 if=/dev/zero of=/dev/nvme0n1 oflag=direct seek=200
done
echo BENCH-DONE
poweroff -f
