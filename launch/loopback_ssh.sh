#!/usr/bin/env bash
# Serve ssh on 127.0.0.1 for the hosts node0 node1 ..., so that a multi-node launch
# over ssh (`deepspeed --hostfile H`, pdsh) can be tried on one machine.
#
#   launch/loopback_ssh.sh DIR PORT [HOST ...]     # hosts default to node0 node1
#
# Writes into DIR a host key, a client key, sshd_config, ssh_config (every HOST is
# 127.0.0.1:PORT) and bin/ssh, a wrapper that uses that ssh_config: put DIR/bin first
# on PATH and `ssh node1` (DeepSpeed's checks, pdsh) reaches this server. Then runs
# sshd in the foreground (stop it with SIGTERM); no root needed, nothing outside DIR
# is written. Exits 3 where no sshd is installed (apt-get install openssh-server).
set -eu

if [ $# -lt 2 ]; then
  echo "usage: $0 DIR PORT [HOST ...]" >&2
  exit 2
fi
dir="$(cd "$1" && pwd)"
port="$2"
shift 2
hosts="${*:-node0 node1}"

sshd="$(command -v sshd || true)"
if [ -z "$sshd" ] && [ -x /usr/sbin/sshd ]; then
  sshd=/usr/sbin/sshd
fi
if [ -z "$sshd" ]; then
  echo "$0: no sshd on this machine (looked on PATH and at /usr/sbin/sshd)" >&2
  exit 3
fi

[ -f "$dir/host_key" ] || ssh-keygen -q -t ed25519 -N "" -f "$dir/host_key"
[ -f "$dir/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$dir/id_ed25519"
cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
chmod 600 "$dir/authorized_keys"

cat > "$dir/sshd_config" <<CONF
ListenAddress 127.0.0.1
Port $port
HostKey $dir/host_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
PermitUserEnvironment no
LogLevel ERROR
CONF

cat > "$dir/ssh_config" <<CONF
Host $hosts
  HostName 127.0.0.1
  Port $port
  IdentityFile $dir/id_ed25519
  IdentitiesOnly yes
  BatchMode yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
CONF

# Made whole, then renamed into place: whoever waits for bin/ssh to appear may run it at once.
mkdir -p "$dir/bin"
cat > "$dir/bin/ssh.tmp" <<CONF
#!/bin/sh
exec $(command -v ssh) -F "$dir/ssh_config" "\$@"
CONF
chmod +x "$dir/bin/ssh.tmp"
mv "$dir/bin/ssh.tmp" "$dir/bin/ssh"

# sshd insists on an absolute path, and on its privilege-separation directory.
[ -d /run/sshd ] || mkdir -p /run/sshd 2>/dev/null || true
exec "$sshd" -D -e -f "$dir/sshd_config"
