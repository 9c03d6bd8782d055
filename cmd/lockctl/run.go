//go:build unix

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const exitCodesHelp = `Exit codes:
  N        the command's own exit status
  128+N    the command died by signal N (130 SIGINT, 143 SIGTERM, ...), or
           lockctl got signal N before the command started (connecting,
           waiting), or while releasing, and gave up on the release after 0.5s
  143      the hold was lost; the command's group ended after SIGTERM
  137      the hold was lost; the group was killed with SIGKILL after --grace,
           or at the session's deadline (contact lost, lockctl stopped); or
           the deadline passed before the guard could start the command
  75       --try: the lock is held by someone else
  124      --timeout passed while waiting
  126      the command is there but could not be started (not executable, a
           directory, no #! line, a missing #! interpreter, arguments too
           long, fork failed); the lock is released at once
  127      the command was not found
  1        lockctl's own error: etcd unreachable, authentication, permission,
           the hold lost before the command started
  2        usage: unknown flag, missing --, empty name, bad --sem or --permits`

const childHelp = `The command runs without a shell, in a process group of its own, with
lockctl's stdin, stdout and stderr, and with these variables:
  ETCDSYNC_NAME   the name
  ETCDSYNC_KEY    the held key (also ETCD_LOCK_KEY, as etcdctl lock)
  ETCDSYNC_REV    the key's create revision: a fencing token that increases
                  from one holder to the next (also ETCD_LOCK_REV)
  ETCDSYNC_LEASE  the session's lease ID in hex (the key's last part)
SIGINT, SIGTERM, SIGHUP and SIGQUIT to lockctl go to the whole group (one
that comes while the command starts, as soon as it runs). Before the
command starts they end lockctl at once (128+N), releasing what it took;
after it ended, they give the release half a second more, then lockctl gives
up and leaves the key to its lease's expiry (128+N). When
the hold is lost (the lease revoked, the key deleted) the group gets SIGTERM
at once and SIGKILL after --grace or at the session's deadline, whichever
comes first; when contact with etcd is lost (no keepalive acknowledged within
the TTL, so that the server may expire the lease) the group gets SIGKILL at
the session's deadline. A guard process (lockctl __guard in ps) starts the
command and kills its group by that deadline even if lockctl is killed,
stopped or hangs. Processes the command leaves in its group get SIGTERM and
SIGKILL too before the hold is released. Then lockctl releases the hold and
revokes its lease, so that nothing is left in etcd.`

// slackHelp is --slack's help.
const slackHelp = "how long the lease outlives the TTL, so that a lockctl running late (short of CPU) stops its command before anyone else holds (whole seconds; 0: off)"

// holdFlags are the flags of the commands that take a hold.
type holdFlags struct {
	ttl         time.Duration
	timeout     time.Duration
	grace       time.Duration
	lockDelay   time.Duration
	slack       slackFlag
	logLevel    string // off, or a key of logLevels
	metricsAddr string // host:port to serve /metrics and /healthz on, or ""
	quiet       bool   // say nothing on stderr about waiting (see waiting.go)
}

// register adds the flags to cmd.
func (f *holdFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.DurationVar(&f.ttl, "ttl", 10*time.Second, "session TTL: how long after lost contact with etcd the command is stopped (whole seconds, at least 1s); failover after a crash takes the TTL plus --slack plus --lock-delay")
	fs.Var(&f.slack, "slack", slackHelp)
	fs.DurationVar(&f.timeout, "timeout", 0, "give up waiting after this long (exit 124); 0 waits forever")
	fs.DurationVar(&f.grace, "grace", 10*time.Second, "after a loss, time between SIGTERM and SIGKILL to the command's group")
	fs.DurationVar(&f.lockDelay, "lock-delay", 0, "if this lockctl loses contact with etcd while holding, keep the next holder out for this long after it stopped the command (whole seconds; 0: off)")
	fs.StringVar(&f.logLevel, "log-level", "off", logLevelHelp)
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve Prometheus metrics on http://ADDR/metrics and health on http://ADDR/healthz while running (for example 127.0.0.1:9464)")
	fs.BoolVar(&f.quiet, "quiet", false, "say nothing on stderr about waiting for the lock (errors are still printed)")
}

// check reports a bad value as a usage error.
func (f *holdFlags) check() error {
	switch {
	case f.ttl < time.Second:
		return usage(fmt.Errorf("--ttl %v: want at least 1s", f.ttl))
	case f.timeout < 0:
		return usage(fmt.Errorf("--timeout %v: want 0 or more", f.timeout))
	case f.grace < 0:
		return usage(fmt.Errorf("--grace %v: want 0 or more", f.grace))
	case f.lockDelay < 0:
		return usage(fmt.Errorf("--lock-delay %v: want 0 or more", f.lockDelay))
	case f.slack.d < 0:
		return usage(fmt.Errorf("--slack %v: want 0 or more", f.slack.d))
	}
	return f.checkObservability()
}

// slackFlag is --slack: a duration, or unset for the library's default.
type slackFlag struct {
	d   time.Duration
	set bool
}

func (f *slackFlag) String() string {
	if !f.set {
		return "max(2s, TTL/10)"
	}
	return f.d.String()
}

func (f *slackFlag) Set(v string) error {
	d, err := time.ParseDuration(v)
	if err != nil {
		return err
	}
	f.d, f.set = d, true
	return nil
}

func (f *slackFlag) Type() string { return "duration" }

// runFlags are run's flags.
type runFlags struct {
	holdFlags
	try          bool
	read, write  bool
	sem, permits int64
}

// newRunCmd is "lockctl run".
func newRunCmd(conn *connFlags) *cobra.Command {
	f := &runFlags{}
	cmd := &cobra.Command{
		Use:   "run [flags] NAME [NAME...] -- CMD [ARG...]",
		Short: "Run a command while holding a lock on NAME (or on every NAME)",
		Long: `Run CMD while holding a lock on NAME, and release the lock when CMD ends.

By default the lock is an etcdsync Mutex: its key is NAME/<lease-hex>, the
key etcdctl lock and etcd's concurrency package use, so they exclude each
other. --read and --write take an RWMutex's read or write hold (many readers
or one writer); --sem N takes --permits (default 1) of a semaphore of N.

With several names, lockctl holds a lock on every one of them (an etcdsync
MultiLock: the same keys as a Mutex on each name, written at once), or on
none: two lockctl runs that name the same locks in any order never wait for
each other in a circle. The command then also gets ETCDSYNC_NAMES and
ETCDSYNC_KEYS (one per line, names sorted); ETCDSYNC_NAME and ETCDSYNC_KEY
are the first name's, and ETCDSYNC_REV is the fencing token of every name
(their keys share one create revision). Losing the lock on any name is
losing the hold.

` + waitHelp + "\n\n" + childHelp + "\n\n" + exitCodesHelp,
		Example: `  lockctl run nightly-report -- /usr/local/bin/report --since yesterday
  lockctl run --try --endpoints 10.0.0.1:2379 backup -- sh -c 'tar c /data | upload'
  lockctl run --sem 3 --timeout 10m downloads -- fetch.sh
  lockctl run accounts/alice accounts/bob -- transfer alice bob 10`,
		Args: cobra.ArbitraryArgs,
		RunE: withCode(func(cmd *cobra.Command, args []string) error {
			names, argv, err := splitArgs(cmd, args, 1, -1)
			if err != nil {
				return err
			}
			if argv == nil {
				return usage(fmt.Errorf("%w (see '%s --help')", errMissingDash, cmd.CommandPath()))
			}
			if err := f.check(cmd, len(names)); err != nil {
				return err
			}
			for _, name := range names {
				if err := checkName(cmd, name); err != nil {
					return err
				}
			}
			names = slices.Compact(slices.Sorted(slices.Values(names)))
			return runHeld(conn, names, f.holdFlags, f.try, f.newHold, argv)
		}),
	}
	f.holdFlags.register(cmd)
	fs := cmd.Flags()
	fs.BoolVar(&f.try, "try", false, "do not wait: exit 75 at once when the lock is held")
	fs.BoolVar(&f.read, "read", false, "take a read hold of an RWMutex (shared with other readers)")
	fs.BoolVar(&f.write, "write", false, "take the write hold of an RWMutex (excludes readers and writers)")
	fs.Int64Var(&f.sem, "sem", 0, "take permits of a semaphore with this many permits in all")
	fs.Int64Var(&f.permits, "permits", 1, "with --sem: how many permits to take")
	return cmd
}

// check reports a bad combination of run's flags as a usage error.
func (f *runFlags) check(cmd *cobra.Command, names int) error {
	fs := cmd.Flags()
	kinds := 0
	for _, set := range []bool{f.read, f.write, fs.Changed("sem")} {
		if set {
			kinds++
		}
	}
	switch {
	case kinds > 1:
		return usage(errHoldExclude)
	case kinds > 0 && names > 1:
		return usage(errSeveralNames)
	case f.try && fs.Changed("timeout"):
		return usage(errTryTimeout)
	case fs.Changed("sem") && f.sem < 1:
		return usage(fmt.Errorf("--sem %d: want at least 1", f.sem))
	case fs.Changed("permits") && !fs.Changed("sem"):
		return usage(errPermitsNoSem)
	case fs.Changed("sem") && (f.permits < 1 || f.permits > f.sem):
		return usage(fmt.Errorf("--permits %d: want 1 to --sem %d", f.permits, f.sem))
	}
	return f.holdFlags.check()
}

// newHold returns the hold the flags ask for.
func (f *runFlags) newHold(s *etcdsync.Session, names []string) hold {
	name := names[0]
	switch {
	case len(names) > 1:
		return multiHold(s, names)
	case f.read:
		return readHold(s, name)
	case f.write:
		return writeHold(s, name)
	case f.sem > 0:
		return semaphoreHold(s, name, f.sem, f.permits)
	}
	return mutexHold(s, name)
}

// splitArgs splits args at "--" into the arguments before it, from least
// to most of them (-1: any number), and the command after it. With no
// "--", all of args must be the arguments before it and the command is nil
// (elect without a command); run asks for one.
func splitArgs(cmd *cobra.Command, args []string, least, most int) (before, command []string, err error) {
	dash := cmd.ArgsLenAtDash()
	if dash < 0 {
		if most >= 0 && len(args) > most {
			return nil, nil, usage(fmt.Errorf("%w (see '%s --help')", errMissingDash, cmd.CommandPath()))
		}
		before = args
	} else {
		before, command = args[:dash], args[dash:]
	}
	if len(before) < least || most >= 0 && len(before) > most {
		return nil, nil, usage(fmt.Errorf("want %s before --, got %d argument(s) (see '%s --help')", argNames[most], len(before), cmd.CommandPath()))
	}
	if dash >= 0 && len(command) == 0 {
		return nil, nil, usage(errNoCmdAfter)
	}
	return before, command, nil
}

var argNames = map[int]string{-1: "NAME [NAME...]", 2: "NAME VALUE"}

// conn is a client and a session (a lease kept alive) on it.
type conn struct {
	cli         *clientv3.Client
	s           *etcdsync.Session
	health      *health // what /healthz answers
	stopMetrics func() error
	cancel      context.CancelCauseFunc // ends the client's context, once it is closed
	sigs        <-chan os.Signal        // lockctl's signals, which cut the release short (see close)
	signalled   syscall.Signal          // a signal that came before close, for close (see outcome.signal)
}

// releaseGrace is how long the release may go on after a signal; then
// lockctl gives up on it (see conn.close).
const releaseGrace = 500 * time.Millisecond

// open dials etcd (bounded by --dial-timeout), starts serving metrics if
// asked, and starts a session with f's TTL (bounded by the TTL). A signal
// on sigs meanwhile ends it at once (exit 128+N): it cancels the client's
// context, which ends the dial and NewSession. On error nothing is left
// open, nor held. The caller closes c.
func open(cf *connFlags, name string, f holdFlags, sigs <-chan os.Signal) (*conn, error) {
	hl := &health{}
	opts, stopMetrics, err := f.sessionOptions(hl)
	if err != nil {
		return nil, err
	}
	// The client's context: only a signal while connecting ends it, and
	// then close, after closing the client.
	ctx, cancel := context.WithCancelCause(context.Background())
	stop := watchSignals(sigs, func(sig syscall.Signal) { cancel(signalError{sig: sig}) })
	cli, err := cf.dial(ctx, name+"/")
	var s *etcdsync.Session
	if err == nil {
		opts = append(opts, etcdsync.WithTTL(f.ttl), etcdsync.WithLockDelay(f.lockDelay))
		if f.slack.set {
			opts = append(opts, etcdsync.WithSlack(f.slack.d))
		}
		s, err = etcdsync.NewSession(cli, opts...)
	}
	if sig := stop(); sig != 0 { // the client is of no use now: what closing it fails at is moot
		if s != nil {
			s.Close()
		}
		if cli != nil {
			cli.Close()
		}
		cancel(nil)
		return nil, joinExit(fail(exitSignal+int(sig), fmt.Errorf("%s while connecting to etcd at %s", signalError{sig: sig}, strings.Join(cf.endpoints, ","))), stopMetrics())
	}
	if err != nil {
		var cerr error
		if cli != nil {
			cerr = cli.Close()
		}
		cancel(nil)
		return nil, joinExit(err, cerr, stopMetrics())
	}
	hl.set("waiting", s.Check)
	return &conn{cli: cli, s: s, health: hl, stopMetrics: stopMetrics, cancel: cancel, sigs: sigs}, nil
}

// close releases h if it still holds (bounded by the TTL), then ends the
// session, revoking its lease (bounded by the TTL), and closes the client.
// It returns what failed; a session that had already ended is not an error
// (its lease is gone, or expires on the server by itself). A signal on
// c.sigs (or c.signalled) gives the release releaseGrace more; then close gives
// up: it closes the client, which ends the RPC in flight, leaves the key to
// its lease's expiry on the server (within the TTL), and returns only that,
// as an exit 128+N.
func (c *conn) close(h *hold) error {
	done, watched := make(chan struct{}), make(chan struct{})
	var gaveUp syscall.Signal // written before watched closes
	go func() {
		defer close(watched)
		sig := c.signalled
		if sig == 0 {
			select {
			case got := <-c.sigs:
				sig = sysSignal(got)
			case <-done:
				return
			}
		}
		timer := time.NewTimer(releaseGrace)
		defer timer.Stop()
		select {
		case <-timer.C:
			gaveUp = sig
			c.cli.Close()
		case <-done:
		}
	}()
	var errs []error
	what := "the session's lease"
	if h != nil {
		what = h.Key()
		ctx, cancel := context.WithTimeout(context.Background(), c.s.TTL())
		if err := h.release(ctx); err != nil && !errors.Is(err, etcdsync.ErrLockReleased) && c.s.Err() == nil {
			errs = append(errs, fmt.Errorf("release %s: %w", h.Key(), err))
		}
		cancel()
	}
	ended := c.s.Err() != nil
	if err := c.s.Close(); err != nil && !ended {
		errs = append(errs, err)
	}
	close(done)
	<-watched
	if err := c.cli.Close(); err != nil && gaveUp == 0 {
		errs = append(errs, fmt.Errorf("close the client: %w", err))
	}
	c.cancel(nil)
	if err := c.stopMetrics(); err != nil {
		errs = append(errs, err)
	}
	if gaveUp != 0 {
		return fail(exitSignal+int(gaveUp), errors.Join(append([]error{fmt.Errorf("%s while releasing %s: gave up after %v; it is left to expire on etcd (within --ttl %v)", signalError{sig: gaveUp}, what, releaseGrace, c.s.TTL())}, errs...)...))
	}
	return errors.Join(errs...)
}

// openHeld opens a session (see open) and takes the hold newHold makes on
// it (see acquire), as --timeout and sigs allow. It blocks until then. On
// error it has closed the session and holds nothing; a hold lost as it
// began is an error (exit 1). Unless try or --quiet, it says on stderr
// that it waits, and then that it holds (see waitReport). The caller
// closes c (withClose).
func openHeld(cf *connFlags, names []string, f holdFlags, try bool, newHold func(*etcdsync.Session, []string) hold, sigs <-chan os.Signal) (*conn, hold, error) {
	c, err := open(cf, names[0], f, sigs)
	if err != nil {
		return nil, hold{}, err
	}
	h := newHold(c.s, names)
	name := strings.Join(names, ", ")
	var rep *waitReport
	if !try && !f.quiet {
		rep = startWaitReport(os.Stderr, c.cli, c.s.Lease(), names, h.what, cf.dialTimeout, waitFirst, waitEvery)
	}
	err = acquire(h, name, try, f.timeout, sigs)
	waited, took := false, time.Duration(0)
	if rep != nil {
		waited, took = rep.stop()
	}
	if err != nil {
		return nil, hold{}, withClose(err, c, nil)
	}
	select {
	case <-h.Done(): // also starts the watch of the key
		return nil, hold{}, withClose(fail(exitFailure, fmt.Errorf("lost the %s on %s as it began: %v", h.what, name, h.Err())), c, &h)
	default:
	}
	if waited {
		keys := []string{h.Key()}
		if h.keys != nil {
			keys = h.keys()
		}
		rep.got(took, keys, h.Rev())
	}
	c.health.set(fmt.Sprintf("holding %s %d", h.Key(), h.Rev()), h.Check)
	return c, h, nil
}

// withClose closes c (releasing h) and returns err with what closing
// failed at (see joinExit); when a signal cut the release short, with its
// exit code (128+N).
func withClose(err error, c *conn, h *hold) error {
	cerr := c.close(h)
	var cut *exitError
	if !errors.As(cerr, &cut) {
		return joinExit(err, cerr)
	}
	var ee *exitError
	if err == nil || errors.As(err, &ee) && ee.err == nil {
		return cerr
	}
	return fail(cut.code, fmt.Errorf("%w; %w", err, cut.err))
}

// joinExit returns err, with what the clean-ups failed at added to its
// message and its exit code kept; a nil err becomes the clean-up error, if
// any, exiting 1.
func joinExit(err error, cleanups ...error) error {
	cerr := errors.Join(cleanups...)
	if cerr == nil {
		return err
	}
	if err == nil {
		return fail(exitFailure, cerr)
	}
	code := exitFailure
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
		if ee.err == nil {
			return fail(code, cerr)
		}
	}
	return fail(code, fmt.Errorf("%w; %w", err, cerr))
}

// runHeld is run, and elect with a command: it takes the hold newHold
// makes, runs the command under it (see child.supervise), then releases
// the hold and ends the session. It blocks until all that is done: the
// wait as --timeout and signals allow, the command as long as it runs,
// the clean-up bounded by the TTL.
func runHeld(cf *connFlags, names []string, f holdFlags, try bool, newHold func(*etcdsync.Session, []string) hold, argv []string) error {
	path, err := lookCommand(argv[0])
	if err != nil {
		return err
	}
	sigs, stopSignals := notifySignals()
	defer stopSignals()
	name := strings.Join(names, ", ")
	c, h, err := openHeld(cf, names, f, try, newHold, sigs)
	if err != nil {
		return err
	}
	if err := labelHold(h, name, cf.dialTimeout, sigs); err != nil {
		return withClose(err, c, &h)
	}
	lost := h.Done()
	// Right before the guard: a signal since the hold was taken, or a hold
	// no longer current (lockctl was stopped past the deadline), starts
	// nothing.
	select {
	case got := <-sigs:
		sig := sysSignal(got)
		return withClose(fail(exitSignal+int(sig), fmt.Errorf("%s before %s started; released the %s on %s", signalError{sig: sig}, argv[0], h.what, name)), c, &h)
	default:
	}
	err = c.s.Check()
	if err == nil {
		err = h.Check()
	}
	if err != nil {
		return withClose(fail(exitFailure, fmt.Errorf("lost the %s on %s before the command started: %v", h.what, name, err)), c, &h)
	}
	becomeSubreaper() // best effort: should the guard die, lockctl reaps the group
	ch, err := startChild(path, argv, childEnv(names, h, c.s.Lease()), f.grace, c.s.Deadline(), sigs)
	if errors.Is(err, errDeadlinePassed) {
		return withClose(fail(exitSignal+int(syscall.SIGKILL), fmt.Errorf("lost the %s on %s: %w", h.what, name, err)), c, &h)
	}
	if err != nil {
		return withClose(err, c, &h)
	}
	out := ch.supervise(c.s, sigs, lost, f.grace, lossHooks{
		loss: func() syscall.Signal {
			report(os.Stderr, lossMessage(h, name, f.grace))
			return lossSignal(h)
		},
		leftover: func() {
			report(os.Stderr, fmt.Errorf("the command left processes in its group; sending them SIGTERM (SIGKILL after --grace %v) before releasing the %s on %s", f.grace, h.what, name))
		},
		deadline: func() {
			if !time.Now().Before(c.s.Deadline()) { // the session ends now: wait for its cause, briefly
				select {
				case <-lost:
				case <-time.After(time.Second):
				}
			}
			report(os.Stderr, deadlineMessage(h, name))
		},
	})
	c.signalled = out.signal
	if out.guard != nil {
		return withClose(fail(exitFailure, out.guard), c, &h)
	}
	return withClose(exitStatus(out.code()), c, &h)
}

// childEnv is lockctl's environment plus the hold's variables; with
// several names, the first name's, and every name and key.
func childEnv(names []string, h hold, lease clientv3.LeaseID) []string {
	env := holdEnv(names[0], h.Key(), h.Rev(), lease)
	if h.keys != nil {
		env = append(env, "ETCDSYNC_NAMES="+strings.Join(names, "\n"), "ETCDSYNC_KEYS="+strings.Join(h.keys(), "\n"))
	}
	return env
}

// holdEnv is lockctl's environment plus the variables of one hold on name:
// its key, its fencing token rev, and the session's lease.
func holdEnv(name, key string, rev int64, lease clientv3.LeaseID) []string {
	r := strconv.FormatInt(rev, 10)
	return append(os.Environ(),
		"ETCDSYNC_NAME="+name,
		"ETCDSYNC_KEY="+key,
		"ETCDSYNC_REV="+r,
		fmt.Sprintf("ETCDSYNC_LEASE=%x", int64(lease)),
		"ETCD_LOCK_KEY="+key,
		"ETCD_LOCK_REV="+r,
	)
}

// newElectCmd is "lockctl elect".
func newElectCmd(conn *connFlags) *cobra.Command {
	f := &holdFlags{}
	try := false
	cmd := &cobra.Command{
		Use:   "elect [flags] NAME VALUE [-- CMD [ARG...]]",
		Short: "Campaign for leadership of NAME; run a command only while leading",
		Long: `Campaign for leadership of the election NAME with VALUE (an etcdsync
Election: key NAME/<lease-hex>, as etcdctl elect).

With a command, run it once elected, stop it when leadership is lost, and
resign when it ends; it is run as "lockctl run" runs it, with the same
variables and exit codes.

Without a command, print "<create-revision> <key> <quoted value>" once
elected and lead until SIGINT or SIGTERM, then hand over and exit 0; a
lost leadership is exit 1, a signal before election 128+N.

Either way the leadership ends with a handover: the command has ended (or
there is none), then lockctl resigns, so that the next candidate leads at
once rather than after the TTL, and never while the command still runs.

` + waitHelp + "\n\n" + childHelp + "\n\n" + exitCodesHelp,
		Example: `  lockctl elect billing-leader host-a -- /usr/local/bin/billing-loop
  lockctl elect billing-leader host-a      # hold leadership until Ctrl-C`,
		Args: cobra.ArbitraryArgs,
		RunE: withCode(func(cmd *cobra.Command, args []string) error {
			nv, argv, err := splitArgs(cmd, args, 2, 2)
			if err != nil {
				return err
			}
			if err := f.check(); err != nil {
				return err
			}
			name, value := nv[0], nv[1]
			if err := checkName(cmd, name); err != nil {
				return err
			}
			newHold := func(s *etcdsync.Session, names []string) hold { return electionHold(s, names[0], value) }
			if try && cmd.Flags().Changed("timeout") {
				return usage(errTryTimeout)
			}
			if argv == nil {
				return lead(conn, name, value, *f, try, newHold, cmd.OutOrStdout())
			}
			return runHeld(conn, []string{name}, *f, try, newHold, argv)
		}),
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&try, "try", false, "do not wait: exit 75 at once when someone leads or campaigns")
	return cmd
}

// lead is elect without a command: it campaigns, prints the term, and
// leads until a signal (exit 0, after resigning) or the end of the
// leadership (exit 1). It blocks until then.
func lead(cf *connFlags, name, value string, f holdFlags, try bool, newHold func(*etcdsync.Session, []string) hold, stdout io.Writer) error {
	sigs, stopSignals := notifySignals()
	defer stopSignals()
	c, h, err := openHeld(cf, []string{name}, f, try, newHold, sigs)
	if err != nil {
		return err
	}
	key, rev, lost := h.Key(), h.Rev(), h.Done()
	fmt.Fprintf(stdout, "%d %s %s\n", rev, key, strconv.Quote(value))
	select {
	case <-sigs:
		return withClose(nil, c, &h)
	case <-lost:
		return withClose(fail(exitFailure, fmt.Errorf("lost the leadership on %s: %v", name, h.Err())), c, &h)
	}
}

// labelHold writes who holds (host and pid) as the held key's value (each
// key's, with several names), where the hold's value means nothing else, so
// that lockctl holders and a waiting lockctl show it. It blocks for one RPC
// bounded by timeout and by a signal on sigs; a failure is exit 1, a signal
// 128+N (the caller then releases the hold).
func labelHold(h hold, name string, timeout time.Duration, sigs <-chan os.Signal) error {
	if h.label == nil {
		return nil
	}
	host, err := os.Hostname()
	if err != nil {
		host = "?"
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	stop := watchSignals(sigs, func(sig syscall.Signal) { cancel(signalError{sig: sig}) })
	tctx, tcancel := context.WithTimeout(ctx, timeout)
	defer tcancel()
	err = h.label(tctx, fmt.Sprintf("lockctl host=%s pid=%d", host, os.Getpid()))
	if sig := stop(); sig != 0 {
		return fail(exitSignal+int(sig), fmt.Errorf("%s before the command started; released the %s on %s", signalError{sig: sig}, h.what, name))
	}
	if err != nil {
		return fail(exitFailure, fmt.Errorf("write who holds the %s on %s: %w", h.what, name, err))
	}
	return nil
}

// checkObservability reports a bad --log-level as a usage error.
func (f *holdFlags) checkObservability() error {
	if _, ok := logLevels[f.logLevel]; !ok && f.logLevel != "off" {
		return usage(fmt.Errorf("--log-level %q: want off, debug, info, warn or error", f.logLevel))
	}
	return nil
}

// sessionOptions returns the session's options for --log-level (records on
// stderr) and --metrics-addr (metrics, and hl's answer on /healthz, served
// until stop is called), and the func that stops the server (bounded by a
// second) and returns what it failed at; it does not block. A metrics
// address that cannot be listened on is an error (exit 1).
func (f *holdFlags) sessionOptions(hl *health) (opts []etcdsync.SessionOption, stop func() error, err error) {
	stop = func() error { return nil }
	if level, ok := logLevels[f.logLevel]; ok {
		opts = append(opts, etcdsync.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))))
	}
	if f.metricsAddr == "" {
		return opts, stop, nil
	}
	reg := prometheus.NewRegistry()
	m, err := etcdsync.NewMetrics(reg)
	if err != nil {
		return nil, stop, fail(exitFailure, err)
	}
	ln, err := net.Listen("tcp", f.metricsAddr)
	if err != nil {
		return nil, stop, fail(exitFailure, fmt.Errorf("--metrics-addr: %w", err))
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/healthz", hl)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	stop = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		err := srv.Shutdown(ctx)
		if err != nil {
			err = errors.Join(err, srv.Close())
		}
		if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
		if err != nil {
			return fmt.Errorf("metrics server: %w", err)
		}
		return nil
	}
	return append(opts, etcdsync.WithMetrics(m)), stop, nil
}
