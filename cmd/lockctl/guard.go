//go:build unix

package main

// The guard: what bounds the command by the hold even when lockctl cannot.
//
// lockctl does not start the command itself. It starts a guard (this same
// binary, see guardArg), and the guard starts the command as the leader of a
// process group of its own. lockctl hands the guard, on a pipe, the session's
// local deadline (the earliest instant etcd may give the hold to another)
// each time an acknowledged keepalive moves it, until the hold ends. Then:
//
//   - when the deadline passes with no later one on the pipe (lockctl stopped,
//     hung, or its hold lost), the guard kills the group with SIGKILL;
//   - when the pipe closes while the group lives (lockctl died), it sends the
//     group SIGTERM, and SIGKILL after --grace or at the deadline, whichever
//     comes first.
//
// The guard leads a process group of its own (not lockctl's, not the
// command's): a signal to lockctl's job or to the command's group does not
// stop it. It reaps the group's processes (as a child subreaper on Linux)
// and exits once none is left. On a second pipe it tells lockctl, first,
// that the command runs (its group) or that it did not start it (the errno
// its exec failed with, or that the deadline it was given had passed: it
// never execs the command after it), then the command's status once it
// exits, and that it killed the group at the deadline. Everything else of a live run stays
// lockctl's: forwarding signals, SIGTERM and --grace after a loss, processes
// left behind (see child.supervise).

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// guardArg as lockctl's first argument starts the guard:
//
//	lockctl __guard GRACE PATH ARGV0 [ARG...]
//
// with the deadlines to read on file descriptor 3 and the records to write
// on 4. Nothing else starts lockctl so.
const guardArg = "__guard"

// The guard's records to lockctl, one line each.
const (
	recStarted = "started" // PGID: the command runs, leading group PGID
	recFailed  = "failed"  // ERRNO MESSAGE: the command could not be started (ERRNO 0: the error was no errno)
	recExpired = "expired" // the deadline had passed: the command was not started
	recExited  = "exited"  // STATUS LEFT: the command's wait status; whether processes are left in its group
	recKilled  = "killed"  // the deadline passed: the group got SIGKILL
)

// monoNow is the time on CLOCK_MONOTONIC, the clock lockctl and the guard
// share (the same machine, the same time namespace), in nanoseconds.
func monoNow() int64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// monoDeadline returns d on CLOCK_MONOTONIC. The clock is read before d's
// distance is taken, so a pause between the two makes it earlier, never later.
func monoDeadline(d time.Time) int64 {
	mono := monoNow()
	return mono + int64(time.Until(d))
}

// untilMono is the time left until deadline (CLOCK_MONOTONIC nanoseconds).
func untilMono(deadline int64) time.Duration { return time.Duration(deadline - monoNow()) }

// writeDeadline writes d on w as the guard reads it.
func writeDeadline(w io.Writer, d time.Time) error {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(monoDeadline(d)))
	_, err := w.Write(b[:])
	return err
}

// guardMain is lockctl started as a guard with args (after guardArg). It
// blocks until the command and every process left in its group have ended,
// and returns the guard's exit code (lockctl reads the command's status on
// the records).
func guardMain(args []string) int {
	if len(args) < 3 {
		report(os.Stderr, fmt.Errorf("%s is for lockctl's own use", guardArg))
		return exitUsage
	}
	grace, err := time.ParseDuration(args[0])
	if err != nil {
		report(os.Stderr, fmt.Errorf("%s: %w", guardArg, err))
		return exitUsage
	}
	// Neither pipe goes to the command: its processes must not keep the
	// records open (lockctl reads them to their end), nor hold the deadlines.
	syscall.CloseOnExec(3)
	syscall.CloseOnExec(4)
	if err := syscall.SetNonblock(3, true); err != nil { // so that closing it ends a pending read
		report(os.Stderr, fmt.Errorf("%s is for lockctl's own use: %w", guardArg, err))
		return exitUsage
	}
	in, out := os.NewFile(3, "deadlines"), os.NewFile(4, "records")
	g := &guard{grace: grace, out: out}
	return g.run(in, args[1], args[2:])
}

// guard is the guard's state.
type guard struct {
	grace time.Duration
	out   *os.File // the records
}

// record writes one record to lockctl. Once lockctl is gone there is no one
// to tell: a failed write is not an error.
func (g *guard) record(kind string, args ...any) {
	fields := append([]string{kind}, strings.Fields(fmt.Sprint(args...))...)
	fmt.Fprintln(g.out, strings.Join(fields, " "))
}

// run starts the command and guards its group (see the file's comment). It
// blocks until the group has ended, and joins the goroutines it starts.
func (g *guard) run(in *os.File, path string, argv []string) int {
	becomeSubreaper() // best effort: without it, only the guard's own children are reaped
	// The signals lockctl forwards, and those that would stop the guard,
	// are for the command: lockctl signals its group itself.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, append(forwarded, syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)...)
	defer signal.Stop(sigs)

	deadlines, done := make(chan int64), make(chan struct{})
	read := make(chan struct{})
	go func() {
		defer close(read)
		readDeadlines(in, deadlines, done)
	}()
	defer func() {
		close(done)
		in.Close()
		<-read
	}()

	deadline, ok := <-deadlines
	if !ok { // lockctl is gone: the hold is not ours to use
		return exitFailure
	}
	// lockctl writes each deadline as the session's moves: one written while
	// the guard was starting is behind this one on the pipe. Take the latest
	// before deciding; every deadline lockctl writes is one the hold had.
	for untilMono(deadline) <= 0 {
		select {
		case d, ok := <-deadlines:
			if !ok { // lockctl is gone
				return exitFailure
			}
			deadline = max(deadline, d)
		case <-time.After(staleWait): // none later: etcd may have given the hold to another
			g.record(recExpired)
			return exitFailure
		}
	}
	cmd := &exec.Cmd{
		Path:        path,
		Args:        argv,
		Stdin:       os.Stdin,
		Stdout:      os.Stdout,
		Stderr:      os.Stderr,
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	if err := cmd.Start(); err != nil {
		var errno syscall.Errno
		errors.As(err, &errno)
		g.record(recFailed, fmt.Sprintf("%d %v", int(errno), err))
		return exitNoExec
	}
	pgid := cmd.Process.Pid
	g.record(recStarted, pgid)
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		cmd.Wait() // the status is in cmd.ProcessState
	}()

	expire := time.NewTimer(untilMono(deadline))
	defer expire.Stop()
	var kill <-chan time.Time // fires grace after an orphaned guard's SIGTERM
	var killTimer *time.Timer
	defer func() {
		if killTimer != nil {
			killTimer.Stop()
		}
	}()
	var gone chan struct{} // closed when reapGroup returns; nil while the command runs
	for {
		select {
		case d, ok := <-deadlines:
			if ok {
				deadline = max(deadline, d)
				expire.Reset(untilMono(deadline))
				continue
			}
			deadlines = nil // lockctl died: end the group within grace, and by the deadline
			syscall.Kill(-pgid, syscall.SIGTERM)
			killTimer = time.NewTimer(min(g.grace, untilMono(deadline)))
			kill = killTimer.C
		case <-expire.C:
			if left := untilMono(deadline); left > 0 {
				expire.Reset(left)
				continue
			}
			syscall.Kill(-pgid, syscall.SIGKILL)
			g.record(recKilled)
		case <-kill:
			syscall.Kill(-pgid, syscall.SIGKILL)
		case <-exited:
			exited = nil
			ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
			left := groupLeft(pgid)
			g.record(recExited, uint32(ws), left)
			if !left {
				return 0
			}
			gone = make(chan struct{})
			go func() {
				defer close(gone)
				reapGroup(pgid)
			}()
		case <-gone:
			return 0
		case <-sigs:
		}
	}
}

// readDeadlines sends each deadline read from in on out, until in ends
// (then it closes out) or done closes.
func readDeadlines(in io.Reader, out chan<- int64, done <-chan struct{}) {
	defer close(out)
	var b [8]byte
	for {
		if _, err := io.ReadFull(in, b[:]); err != nil {
			return
		}
		select {
		case out <- int64(binary.BigEndian.Uint64(b[:])):
		case <-done:
			return
		}
	}
}

// guardRecord is one record from the guard, parsed.
type guardRecord struct {
	kind   string
	pgid   int
	status syscall.WaitStatus
	left   bool
	errno  syscall.Errno // failed: what the exec returned
	msg    string
}

// err is a failed record's error: its errno, or its message when the
// guard's error was no errno.
func (r guardRecord) err() error {
	if r.errno != 0 {
		return r.errno
	}
	return errors.New(r.msg)
}

// readRecords sends each record read from r on out, and closes out at the
// end of r (the guard has exited) or when a record is malformed.
func readRecords(r io.Reader, out chan<- guardRecord) {
	defer close(out)
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		kind, rest, _ := strings.Cut(sc.Text(), " ")
		rec := guardRecord{kind: kind, msg: rest}
		var err error
		switch kind {
		case recStarted:
			rec.pgid, err = strconv.Atoi(rest)
		case recFailed:
			errno, msg, _ := strings.Cut(rest, " ")
			var n int
			n, err = strconv.Atoi(errno)
			rec.errno, rec.msg = syscall.Errno(n), msg
		case recExited:
			status, left, _ := strings.Cut(rest, " ")
			var ws uint64
			ws, err = strconv.ParseUint(status, 10, 32)
			rec.status, rec.left = syscall.WaitStatus(ws), left == "true"
		}
		if err != nil {
			return
		}
		out <- rec
	}
}

// staleWait is how long a guard whose first deadline has passed waits for a
// later one from lockctl before it reports the hold expired.
const staleWait = time.Second
