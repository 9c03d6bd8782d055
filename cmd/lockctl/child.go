//go:build unix

package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/etcdsync/etcdsync"
)

// forwarded are the signals lockctl catches and passes to the command's
// process group.
var forwarded = []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT}

// notifySignals starts catching the forwarded signals on the returned
// channel; stop undoes it. It does not block.
func notifySignals() (sigs <-chan os.Signal, stop func()) {
	ch := make(chan os.Signal, len(forwarded))
	signal.Notify(ch, forwarded...)
	return ch, func() { signal.Stop(ch) }
}

// watchSignals calls onSignal with the first signal that comes on sigs
// (a nil sigs: none comes) until stop is called; stop then returns that
// signal, or 0. watchSignals does not block; stop blocks until the watching
// goroutine has ended (onSignal must not block). Signals that come after
// stop stay on sigs.
func watchSignals(sigs <-chan os.Signal, onSignal func(syscall.Signal)) (stop func() syscall.Signal) {
	done, watched := make(chan struct{}), make(chan struct{})
	var got syscall.Signal // written before watched closes
	go func() {
		defer close(watched)
		select {
		case sig := <-sigs:
			got = sysSignal(sig)
			onSignal(got)
		case <-done:
		}
	}()
	return func() syscall.Signal {
		close(done)
		<-watched
		return got
	}
}

// sysSignal returns sig as a syscall.Signal (every signal is one on Unix).
func sysSignal(sig os.Signal) syscall.Signal {
	if s, ok := sig.(syscall.Signal); ok {
		return s
	}
	return syscall.SIGTERM
}

// lookCommand finds the command's executable as exec does, before any lock
// is taken: a command that is not there is exit 127, one that is there but
// cannot be run (not executable, a directory) exit 126, as in sh.
func lookCommand(name string) (string, error) {
	path, err := exec.LookPath(name)
	if err == nil {
		return path, nil
	}
	if errors.Is(err, exec.ErrNotFound) || errors.Is(err, fs.ErrNotExist) {
		where := ""
		if !strings.Contains(name, "/") {
			where = " in $PATH"
		}
		return "", fail(exitNotFound, fmt.Errorf("%s: not found%s", name, where))
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return "", fail(exitNoExec, fmt.Errorf("%s: cannot run: %v", name, errno))
	}
	return "", fail(exitNoExec, fmt.Errorf("%s: cannot run: %v", name, err))
}

// startFailure is the error for a command at path (argv0 as given) whose
// exec failed with err: exit 127 when the file is not there, else 126 (it
// is there but cannot be run), as in sh, with one line that names the
// command and the cause. A missing #! interpreter (ENOENT for a file that
// is there) is 126, and named.
func startFailure(argv0, path string, err error) error {
	name := argv0
	if path != argv0 {
		name = fmt.Sprintf("%s (%s)", argv0, path)
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return fail(exitNoExec, fmt.Errorf("%s: cannot run: %v", name, err))
	}
	switch errno {
	case syscall.ENOENT:
		if _, serr := os.Stat(path); serr != nil {
			return fail(exitNotFound, fmt.Errorf("%s: not found", name))
		}
		if interp := interpreter(path); interp != "" {
			return fail(exitNoExec, fmt.Errorf("%s: cannot run: its interpreter %s (the #! line) was not found", name, interp))
		}
		return fail(exitNoExec, fmt.Errorf("%s: cannot run: a file it needs to run (its ELF interpreter) was not found", name))
	case syscall.ENOEXEC:
		return fail(exitNoExec, fmt.Errorf("%s: cannot run: exec format error: not a binary for this system and no #! line (to run it with sh: -- sh %s)", name, argv0))
	}
	return fail(exitNoExec, fmt.Errorf("%s: cannot run: %v", name, errno))
}

// interpreter returns the interpreter that the #! line of the file at path
// names, or "" when it has none (or cannot be read). It reads one line.
func interpreter(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	line, _ := bufio.NewReader(io.LimitReader(f, 256)).ReadString('\n')
	rest, ok := strings.CutPrefix(line, "#!")
	if !ok {
		return ""
	}
	if fields := strings.Fields(rest); len(fields) > 0 {
		return fields[0]
	}
	return ""
}

// child is the command lockctl runs, under its guard (see guard.go): the
// guard's process, the command's process group, the pipe that hands the
// guard the session's deadline, and the guard's records.
type child struct {
	guard     *exec.Cmd
	exited    chan struct{} // closed once the guard is reaped
	pgid      int           // the command's process group (its leader's PID)
	deadlines *os.File      // lockctl's end of the deadlines pipe
	recFile   *os.File      // lockctl's end of the records pipe, read by readRecords
	records   chan guardRecord
	pending   []syscall.Signal // signals that came while the command started, for its group
}

// startGrace bounds the wait for the guard's report past the deadline the
// guard was given, and past a signal that comes meanwhile; then lockctl
// gives up on the guard.
const startGrace = time.Second

// errDeadlinePassed is the cause when the guard did not start the command
// because the deadline it was given had passed.
var errDeadlinePassed = errors.New("the session's deadline passed before the command could start (was lockctl stopped?); the guard did not start it")

// startChild starts the executable at path with argv (argv[0] is its name)
// and env, with lockctl's stdin, stdout and stderr, as the leader of a new
// process group, under a guard that kills the group at deadline unless
// supervise moves it on (see guard.go), and with grace after lockctl dies.
// It blocks until the guard reports that the command started, or that it
// could not start it, bounded by startGrace past deadline, or past a signal
// on sigs (those are kept for the command's group). On error nothing runs:
// exit 126 or 127 as in sh (see startFailure), 128+N when a signal came and
// the guard did not report in time, or errDeadlinePassed; the guard has been
// stopped and the goroutines started here joined. Else the caller
// supervises the child, which joins them.
func startChild(path string, argv, env []string, grace time.Duration, deadline time.Time, sigs <-chan os.Signal) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fail(exitNoExec, fmt.Errorf("%s: not started: find lockctl's own executable for its guard: %w", argv[0], err))
	}
	dr, dw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	rr, rw, err := os.Pipe()
	if err != nil {
		dr.Close()
		dw.Close()
		return nil, err
	}
	if err := writeDeadline(dw, deadline); err != nil { // the pipe holds it for the guard
		dr.Close()
		dw.Close()
		rr.Close()
		rw.Close()
		return nil, err
	}
	guard := &exec.Cmd{
		Path:        exe,
		Args:        append([]string{"lockctl", guardArg, grace.String(), path}, argv...),
		Env:         env,
		Stdin:       os.Stdin,
		Stdout:      os.Stdout,
		Stderr:      os.Stderr,
		ExtraFiles:  []*os.File{dr, rw}, // 3 and 4
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	err = guard.Start()
	// The guard's ends of the pipes: lockctl keeps no copy, so that the
	// records end when the guard (the only writer) has ended.
	dr.Close()
	rw.Close()
	if err != nil {
		dw.Close()
		rr.Close()
		return nil, fail(exitNoExec, fmt.Errorf("%s: not started: its guard (lockctl %s) could not be started: %w", argv[0], guardArg, err))
	}
	c := &child{guard: guard, exited: make(chan struct{}), deadlines: dw, recFile: rr, records: make(chan guardRecord)}
	go func() {
		defer close(c.exited)
		guard.Wait()
	}()
	go func() {
		defer rr.Close()
		readRecords(rr, c.records)
	}()
	if err := c.awaitStart(argv[0], path, deadline, sigs); err != nil {
		c.abort()
		return nil, err
	}
	return c, nil
}

// awaitStart blocks until the guard's first record: the command started
// (nil, with its group in c.pgid), or could not start (the error to exit
// with). Anything else is a failure: the records ending (the guard ended)
// or no record by startGrace past deadline, or past a signal on sigs (see
// startChild).
func (c *child) awaitStart(argv0, path string, deadline time.Time, sigs <-chan os.Signal) error {
	bound := time.NewTimer(time.Until(deadline) + startGrace)
	defer bound.Stop()
	for {
		select {
		case rec, ok := <-c.records:
			switch {
			case !ok:
				select {
				case <-c.exited:
				case <-time.After(startGrace):
				}
				return fail(exitNoExec, fmt.Errorf("%s: not started: its guard (lockctl %s) ended before it reported (%v)", argv0, guardArg, c.guard.ProcessState))
			case rec.kind == recStarted:
				c.pgid = rec.pgid
				return nil
			case rec.kind == recFailed:
				return startFailure(argv0, path, rec.err())
			case rec.kind == recExpired:
				return errDeadlinePassed
			}
			return fail(exitNoExec, fmt.Errorf("%s: not started: its guard reported %q first", argv0, rec.kind))
		case sig := <-sigs:
			if len(c.pending) == 0 {
				bound.Reset(startGrace)
			}
			c.pending = append(c.pending, sysSignal(sig))
		case <-bound.C:
			if len(c.pending) > 0 {
				sig := c.pending[0]
				return fail(exitSignal+int(sig), fmt.Errorf("%s while starting %s: its guard did not report within %v; stopped it", signalError{sig: sig}, argv0, startGrace))
			}
			return fail(exitNoExec, fmt.Errorf("%s: not started: its guard did not report by the session's deadline; stopped it", argv0))
		}
	}
}

// abort ends a guard that did not start the command: it closes the
// deadlines pipe, sends the guard's process group SIGKILL unless the guard
// has exited, and SIGKILL to the command's group should a late record say
// it started; it joins the goroutines startChild started. It blocks for up
// to 2*startGrace (then it stops reading the records, and leaves the
// guard's reaping to its goroutine).
func (c *child) abort() {
	c.deadlines.Close()
	select {
	case <-c.exited:
	default:
		syscall.Kill(-c.guard.Process.Pid, syscall.SIGKILL)
	}
	timer := time.NewTimer(startGrace)
	defer timer.Stop()
	for records := c.records; records != nil; {
		select {
		case rec, ok := <-records:
			if !ok {
				records = nil
			} else if rec.kind == recStarted {
				syscall.Kill(-rec.pgid, syscall.SIGKILL)
			}
		case <-timer.C:
			c.recFile.Close() // ends readRecords
		}
	}
	select {
	case <-c.exited:
	case <-time.After(startGrace):
	}
}

// signal sends sig to the command's whole process group. A group with no
// process left is not an error.
func (c *child) signal(sig syscall.Signal) {
	syscall.Kill(-c.pgid, sig)
}

// feed hands the guard the session's local deadline each time it moves,
// until the hold ends (lost closes), stop closes or the guard is gone. It
// blocks until then.
func (c *child) feed(s *etcdsync.Session, lost, stop <-chan struct{}) {
	for s.Err() == nil {
		moved := s.DeadlineMoved()
		if writeDeadline(c.deadlines, s.Deadline()) != nil {
			return
		}
		select {
		case <-moved:
		case <-lost:
			return
		case <-stop:
			return
		}
	}
}

// outcome is how the command ended.
type outcome struct {
	status  syscall.WaitStatus // the command's, once exited
	exited  bool
	stopped syscall.Signal // after a loss: SIGTERM, or SIGKILL once --grace or the deadline passed; 0 without a loss
	guard   error          // the guard ended before telling the command's status
	signal  syscall.Signal // the first signal forwarded to the group; it cuts the release short too (see conn.close)
}

// code is the exit code for the outcome: 128+signal when the group was
// stopped after a loss (143 or 137), else the command's own status (128+N
// when signal N ended it).
func (o outcome) code() int {
	switch {
	case o.stopped != 0:
		return exitSignal + int(o.stopped)
	case o.status.Signaled():
		return exitSignal + int(o.status.Signal())
	}
	return o.status.ExitStatus()
}

// lossHooks are what supervise reports through.
type lossHooks struct {
	loss     func() syscall.Signal // the hold ended while the command ran: says so, returns the signal for the group now
	leftover func()                // the command left processes in its group
	deadline func()                // the guard killed the group at the deadline, no loss reported before
}

// supervise blocks until the command's process group has ended and the
// guard has exited. Meanwhile it hands the guard the session's deadline (see
// feed), and forwards each signal from sigs (first those that came while the
// command started) to the group; the first is kept in the outcome, for the
// release. When lost closes
// while the command runs, it calls hooks.loss and sends the group the signal
// that returns: SIGTERM, then SIGKILL once grace has passed; or SIGKILL at
// once. Processes the command leaves in its group get the same (hooks.leftover
// is called first, unless a signal was forwarded), since the hold must
// outlive every one of them. It joins the goroutines it and startChild
// started, and closes the deadlines pipe, before returning.
func (c *child) supervise(s *etcdsync.Session, sigs <-chan os.Signal, lost <-chan struct{}, grace time.Duration, hooks lossHooks) outcome {
	stopFeed, fed := make(chan struct{}), make(chan struct{})
	go func(lost <-chan struct{}) { // a copy: the loop below sets its lost to nil
		defer close(fed)
		c.feed(s, lost, stopFeed)
	}(lost)
	defer func() {
		close(stopFeed)
		<-fed
		c.deadlines.Close()
	}()

	var out outcome
	var timer *time.Timer
	var kill <-chan time.Time // fires grace after SIGTERM
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	stop := func(sig syscall.Signal) { // SIGTERM now and SIGKILL after grace, once; or SIGKILL now
		if sig == syscall.SIGKILL {
			c.signal(sig)
		} else if timer == nil {
			c.signal(sig)
			timer = time.NewTimer(grace)
			kill = timer.C
		}
	}
	for _, sig := range c.pending {
		c.signal(sig)
		if out.signal == 0 {
			out.signal = sig
		}
	}
	for {
		select {
		case rec, ok := <-c.records:
			if !ok {
				<-c.exited
				if !out.exited { // the guard died under the command: end the group
					out.guard = fmt.Errorf("the guard ended (%v) while the command ran; its process group got SIGKILL", c.guard.ProcessState)
					c.signal(syscall.SIGKILL)
					reapGroup(c.pgid)
				}
				return out
			}
			switch rec.kind {
			case recExited:
				out.status, out.exited = rec.status, true
				if rec.left && timer == nil && out.stopped != syscall.SIGKILL {
					if out.signal == 0 { // else they may just be ending
						hooks.leftover()
					}
					stop(syscall.SIGTERM)
				}
			case recKilled:
				if lost != nil {
					lost = nil
					hooks.deadline()
				}
				out.stopped = syscall.SIGKILL
			}
		case sig := <-sigs:
			c.signal(sysSignal(sig))
			if out.signal == 0 {
				out.signal = sysSignal(sig)
			}
		case <-lost:
			lost = nil
			if out.exited { // the command ended first: its status stands
				continue
			}
			sig := hooks.loss()
			out.stopped = sig
			stop(sig)
		case <-kill:
			kill = nil
			c.signal(syscall.SIGKILL)
			if out.stopped != 0 {
				out.stopped = syscall.SIGKILL
			}
		}
	}
}

// groupLeft reports whether any process of group pgid is left, after
// reaping those of lockctl's children in it that have exited. It does not
// block.
func groupLeft(pgid int) bool {
	for {
		pid, err := syscall.Wait4(-pgid, nil, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || pid == 0 { // none of our children in it, or none exited
			break
		}
	}
	return syscall.Kill(-pgid, 0) == nil
}

// reapGroup blocks until lockctl has no child left in group pgid, reaping
// each as it exits. As a child subreaper (see becomeSubreaper) lockctl
// inherits the group's orphans, so this waits for the whole group; without
// it, only for lockctl's own children.
func reapGroup(pgid int) {
	for {
		_, err := syscall.Wait4(-pgid, nil, 0, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil { // ECHILD: none left
			return
		}
	}
}

// lossSignal is the signal the command's group gets when h ends under it:
// SIGKILL when contact with etcd was lost (the session's deadline has
// passed: etcd may give the hold to another now), else SIGTERM, then SIGKILL
// after --grace or at the session's deadline, whichever comes first.
func lossSignal(h hold) syscall.Signal {
	if errors.Is(h.Err(), etcdsync.ErrLostContact) {
		return syscall.SIGKILL
	}
	return syscall.SIGTERM
}

// lossMessage is the line lockctl prints when h ends under the command.
func lossMessage(h hold, name string, grace time.Duration) error {
	if lossSignal(h) == syscall.SIGKILL {
		return fmt.Errorf("lost the %s on %s: %v; killing the command's process group (SIGKILL): etcd may give the %s to another holder from now on", h.what, name, h.Err(), h.what)
	}
	return fmt.Errorf("lost the %s on %s: %v; sending SIGTERM to the command's process group (SIGKILL after --grace %v, or at the session's deadline if sooner)", h.what, name, h.Err(), grace)
}

// deadlineMessage is the line lockctl prints when the guard killed the
// command's group at the session's deadline before lockctl saw a loss
// (lockctl was stopped, or could not keep up).
func deadlineMessage(h hold, name string) error {
	cause := "no keepalive acknowledged in time moved the session's deadline on (was lockctl stopped?)"
	if err := h.Err(); err != nil {
		cause = err.Error()
	}
	return fmt.Errorf("lost the %s on %s: %s; the guard killed the command's process group (SIGKILL) at the session's deadline", h.what, name, cause)
}
