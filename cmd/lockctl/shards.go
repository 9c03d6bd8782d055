//go:build unix

package main

// lockctl shards: the library's Shards with a command per shard. Each shard
// this member holds runs the command under its own guard, as lockctl run
// runs its command (startChild, child.supervise); the shard's context ending
// (a move, a loss, lockctl stopping) is the loss that supervise acts on.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

const shardsExitHelp = `Exit codes:
  0        a signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) stopped lockctl once it
           was connected: every command ended, the shards were released
  128+N    signal N came while connecting to etcd, or while releasing, and
           lockctl gave up on the release after 0.5s
  143      the session ended (its lease revoked or expired) or this member's
           key was deleted: every command got SIGTERM and its group ended
  137      the same, but contact with etcd was lost (the groups got SIGKILL
           at the session's deadline), or a group got SIGKILL after --grace
  126      a shard's command is there but could not be started; every other
           command is stopped and the shards released
  127      the command was not found
  1        lockctl's own error: etcd unreachable, authentication, permission,
           another member runs NAME with another N, a guard that died
  2        usage: unknown flag, missing --, empty name, N not a count`

// shardsFlags are the flags of lockctl shards: those of holdFlags it uses
// (the others keep values that mean off), and --max.
type shardsFlags struct {
	holdFlags
	max int
}

// register adds the flags to cmd.
func (f *shardsFlags) register(cmd *cobra.Command) {
	f.logLevel = "off" // no flag: the library's records of failed commands are not printed
	fs := cmd.Flags()
	fs.DurationVar(&f.ttl, "ttl", 10*time.Second, "session TTL: how long after lost contact with etcd the commands are stopped (whole seconds, at least 1s); a crashed member's shards move after the TTL plus --slack")
	fs.Var(&f.slack, "slack", slackHelp)
	fs.DurationVar(&f.grace, "grace", 10*time.Second, "after a shard's move or loss, or a signal, time between SIGTERM (or the signal) and SIGKILL to its command's group")
	fs.BoolVar(&f.quiet, "quiet", false, "print no line when a shard's command starts or stops (errors are still printed)")
	fs.IntVar(&f.max, "max", 0, "hold at most `K` shards on this member (0: no cap); the other members take the rest")
}

// newShardsCmd is "lockctl shards".
func newShardsCmd(conn *connFlags) *cobra.Command {
	f := &shardsFlags{}
	cmd := &cobra.Command{
		Use:   "shards [flags] NAME N -- CMD [ARG...]",
		Short: "Share shards 0 to N-1 of NAME with the other members; run a command for each shard held",
		Long: `Join the members of the shards of NAME (an etcdsync Shards with N shards,
0 to N-1) and run CMD once for each shard this member holds, each shard on
one member at a time, balanced over the members as they come and go: with m
members each holds N/m shards, rounded down or up (--max caps this one).
Shard i is a lock of its own on NAME/i (lockctl holders NAME/i shows its
holder); the members are a group on NAME/members.

Each shard's command runs as lockctl run runs its command (its own process
group, under a guard that kills the group by the session's deadline), with
these variables:
  ETCDSYNC_SHARD   the shard's number, 0 to N-1
  ETCDSYNC_SHARDS  N
  ETCDSYNC_NAME    the shard's lock: NAME/i
  ETCDSYNC_KEY     the held key (also ETCD_LOCK_KEY)
  ETCDSYNC_REV     the key's create revision: the shard's fencing token,
                   increasing from one holder of the shard to the next (also
                   ETCD_LOCK_REV)
  ETCDSYNC_LEASE   the session's lease ID in hex

When the shard moves to another member (one joined) or its hold is lost,
its command's group gets SIGTERM, and SIGKILL after --grace or at the
session's deadline, whichever comes first; when contact with etcd is lost,
SIGKILL. The shard is released only once the group has ended. A command
that exits while its shard is held runs again after a pause: 100ms after
exit 0, doubling after each failure up to 30s.

Unless --quiet, a line on stderr tells when a shard's command starts
("lockctl: shard 3 of NAME: running, revision R") and when it stops (why,
and its exit status).

SIGINT, SIGTERM, SIGHUP and SIGQUIT stop lockctl: every command's group gets
the signal (SIGKILL after --grace or at the session's deadline), then the
shards are released, the member leaves and lockctl exits 0.

` + shardsExitHelp,
		Example: `  lockctl shards ingest 12 -- /usr/local/bin/ingest   # reads ETCDSYNC_SHARD
  lockctl shards --max 2 --ttl 5s tenants 8 -- sh -c 'exec sync-tenant "$ETCDSYNC_SHARD"'`,
		Args: cobra.ArbitraryArgs,
		RunE: withCode(func(cmd *cobra.Command, args []string) error {
			before, argv, err := splitArgs(cmd, args, 0, -1)
			if err != nil {
				return err
			}
			if len(before) != 2 {
				return usage(fmt.Errorf("want NAME N before --, got %d argument(s) (see '%s --help')", len(before), cmd.CommandPath()))
			}
			if argv == nil {
				return usage(fmt.Errorf("%w (see '%s --help')", errMissingDash, cmd.CommandPath()))
			}
			name := before[0]
			n, err := strconv.Atoi(before[1])
			if err != nil || n < 1 {
				return usage(fmt.Errorf("N %q: want a whole number of shards, at least 1", before[1]))
			}
			if f.max < 0 {
				return usage(fmt.Errorf("--max %d: want 0 (no cap) or more", f.max))
			}
			if err := f.holdFlags.check(); err != nil {
				return err
			}
			if err := checkName(cmd, name); err != nil {
				return err
			}
			return runShards(conn, name, n, *f, argv)
		}),
	}
	f.register(cmd)
	return cmd
}

// shardsRun is one lockctl shards: what each shard's fn needs, and what the
// fns tell the exit code.
type shardsRun struct {
	s     *etcdsync.Session
	name  string
	n     int
	path  string
	argv  []string
	grace time.Duration
	quiet bool
	ctx   context.Context         // Run's: its cause says why lockctl stops
	stop  context.CancelCauseFunc // ends Run's context

	mu     sync.Mutex
	killed bool // a command's group got SIGKILL once the session had ended (exit 137)
	out    io.Writer
}

// runShards is lockctl shards: it connects, runs the shards' commands
// until a signal, a command that cannot be started, or the session's end,
// then releases everything. It blocks until then; the clean-up is bounded
// by the TTL (half a second after a signal, see conn.close).
func runShards(cf *connFlags, name string, n int, f shardsFlags, argv []string) error {
	path, err := lookCommand(argv[0])
	if err != nil {
		return err
	}
	sigs, stopSignals := notifySignals()
	defer stopSignals()
	c, err := open(cf, name, f.holdFlags, sigs)
	if err != nil {
		return err
	}
	becomeSubreaper() // best effort: should a guard die, lockctl reaps its group
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	r := &shardsRun{s: c.s, name: name, n: n, path: path, argv: argv, grace: f.grace, quiet: f.quiet, ctx: ctx, stop: cancel, out: os.Stderr}
	watched := watchSignals(sigs, func(sig syscall.Signal) { cancel(signalError{sig: sig}) })
	var opts []etcdsync.ShardsOption
	if f.max > 0 {
		opts = append(opts, etcdsync.WithMaxShards(f.max))
	}
	err = etcdsync.NewShards(c.s, name, n, opts...).Run(ctx, r.serve)
	c.signalled = watched()
	return withClose(r.exit(err), c, nil)
}

// exit is the error lockctl ends with after Run returned err.
func (r *shardsRun) exit(err error) error {
	cause := context.Cause(r.ctx)
	var ee *exitError
	var sig signalError
	switch {
	case errors.As(cause, &ee): // a command could not be started, or its guard died
		return cause
	case errors.As(cause, &sig) && errors.Is(err, context.Canceled):
		return nil
	case errors.Is(err, etcdsync.ErrSessionExpired), errors.Is(err, etcdsync.ErrSessionClosed), errors.Is(err, etcdsync.ErrNotHeld):
		r.mu.Lock()
		killed := r.killed
		r.mu.Unlock()
		// Past the session's deadline (lockctl stopped or starved, then
		// run again), Run may report what followed first, the member's key
		// gone with the expired lease, before the keepalive loop ends the
		// session: the deadline is the cause.
		if lost := r.s.Check(); errors.Is(lost, etcdsync.ErrLostContact) && !errors.Is(err, etcdsync.ErrLostContact) {
			err = lost
		}
		code := exitSignal + int(syscall.SIGTERM)
		if killed || errors.Is(err, etcdsync.ErrLostContact) {
			code = exitSignal + int(syscall.SIGKILL)
		}
		return fail(code, fmt.Errorf("lost the shards of %s: %w", r.name, err))
	}
	return fail(exitFailure, err)
}

// say prints one line on stderr unless --quiet.
func (r *shardsRun) say(format string, args ...any) {
	if r.quiet {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	fmt.Fprintf(r.out, "lockctl: "+format+"\n", args...)
}

// fatal ends lockctl with err (exit 1 unless it says otherwise): Run's
// context ends, every other command is stopped.
func (r *shardsRun) fatal(err error) {
	var ee *exitError
	if !errors.As(err, &ee) {
		err = fail(exitFailure, err)
	}
	r.stop(err)
}

// serve is Run's fn: it runs the command once for shard i, under the guard,
// until it exits or ctx (the shard's) ends, and returns an error when its
// status is not 0. It blocks until the command's group has ended.
func (r *shardsRun) serve(ctx context.Context, i int) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	key, rev, _ := etcdsync.HoldFrom(ctx)
	shard := fmt.Sprintf("shard %d of %s", i, r.name)
	env := append(holdEnv(etcdsync.ShardName(r.name, i), key, rev, r.s.Lease()),
		"ETCDSYNC_SHARD="+strconv.Itoa(i), "ETCDSYNC_SHARDS="+strconv.Itoa(r.n))
	ch, err := startChild(r.path, r.argv, env, r.grace, r.s.Deadline(), nil)
	if errors.Is(err, errDeadlinePassed) {
		r.say("%s: not started, revision %d: %v", shard, rev, err)
		return err
	}
	if err != nil {
		r.fatal(err)
		return err
	}
	r.say("%s: running, revision %d", shard, rev)
	why := "the command exited"
	out := ch.supervise(r.s, nil, ctx.Done(), r.grace, lossHooks{
		loss: func() syscall.Signal {
			var sig syscall.Signal
			why, sig = r.stopping(ctx)
			return sig
		},
		leftover: func() {
			report(r.out, fmt.Errorf("%s: the command left processes in its group; sending them SIGTERM (SIGKILL after --grace %v) before releasing the shard", shard, r.grace))
		},
		deadline: func() {
			why = "the session's deadline passed (contact with etcd lost, or lockctl stopped); the guard killed the command's group (SIGKILL)"
		},
	})
	if out.guard != nil {
		err := fail(exitFailure, fmt.Errorf("%s: %w", shard, out.guard))
		r.fatal(err)
		return err
	}
	code := out.code()
	if out.stopped == syscall.SIGKILL && r.s.Check() != nil { // Check: Err lags a passed deadline
		r.mu.Lock()
		r.killed = true
		r.mu.Unlock()
	}
	r.say("%s: stopped, revision %d: %s (exit %d)", shard, rev, why, code)
	if code != 0 {
		return fmt.Errorf("%s: %s exited with status %d", shard, r.argv[0], code)
	}
	return nil
}

// stopping says why the shard's context ctx ended under its command, and
// the signal for the command's group: the signal lockctl got when it
// stops; SIGKILL when contact with etcd was lost (etcd may give the shard
// to another member from now on); else SIGTERM.
func (r *shardsRun) stopping(ctx context.Context) (why string, sig syscall.Signal) {
	var se signalError
	var ee *exitError
	cause, ended := context.Cause(ctx), r.s.Check() // past the deadline before the keepalive loop ends the session too
	switch {
	case errors.As(context.Cause(r.ctx), &se):
		return fmt.Sprintf("lockctl is stopping (%s); the command's group got %s", se, unix.SignalName(se.sig)), se.sig
	case errors.As(context.Cause(r.ctx), &ee):
		return fmt.Sprintf("lockctl is stopping (%v); the command's group got SIGTERM", ee), syscall.SIGTERM
	case errors.Is(cause, etcdsync.ErrLostContact), errors.Is(ended, etcdsync.ErrLostContact):
		return fmt.Sprintf("lost: %v; the command's group got SIGKILL", firstNonNil(ended, cause)), syscall.SIGKILL
	case ended != nil:
		return fmt.Sprintf("lost: %v; the command's group got SIGTERM", ended), syscall.SIGTERM
	case errors.Is(cause, etcdsync.ErrLockReleased), errors.Is(cause, context.Canceled): // a move
		return "the shard moves to another member; the command's group got SIGTERM", syscall.SIGTERM
	}
	return fmt.Sprintf("lost: %v; the command's group got SIGTERM", cause), syscall.SIGTERM
}

// firstNonNil returns the first of errs that is not nil.
func firstNonNil(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
