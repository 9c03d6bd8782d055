//go:build unix

// Command lockctl runs a command while it holds an etcdsync lock on etcd, so
// that cron jobs and scripts on many hosts never overlap:
//
//	lockctl run NAME -- CMD [ARG...]          # one at a time (a Mutex)
//	lockctl run --sem 3 NAME -- CMD [ARG...]  # at most 3 at a time (a Semaphore)
//	lockctl run --read NAME -- CMD            # many readers or one --write (an RWMutex)
//	lockctl elect NAME VALUE -- CMD           # CMD only while leading (an Election)
//	lockctl observe NAME                      # one line per change of leader
//	lockctl holders NAME [-o json]            # who holds and who waits, in queue order
//	lockctl members NAME [-o json] [--watch]  # a Group's members in join order
//	lockctl shards NAME N -- CMD [ARG...]     # CMD once per shard held (Shards)
//
// The command runs without a shell, in a process group of its own, under a
// guard process that kills the group at the session's local deadline (the
// earliest instant etcd may give the hold to another) whatever happens to
// lockctl (see guard.go). When the hold is lost (the lease was revoked, the
// key was deleted) the group gets SIGTERM at once and SIGKILL after --grace
// or at the deadline; when contact with etcd is lost, SIGKILL at the
// deadline. See "lockctl run --help" for the exit codes.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/grpclog"
)

// Exit codes besides the command's own status.
const (
	exitFailure  = 1   // lockctl's own error: etcd unreachable, auth, permission, hold lost before the command started
	exitUsage    = 2   // bad flags or arguments
	exitHeld     = 75  // --try: the lock is held (EX_TEMPFAIL)
	exitTimeout  = 124 // --timeout passed while waiting (as timeout(1))
	exitNoExec   = 126 // the command was found but could not be started (as sh)
	exitNotFound = 127 // the command was not found (as sh)
	exitSignal   = 128 // 128+N: the command died by signal N, or lockctl was interrupted by N while waiting
)

// Errors lockctl reports by itself.
var (
	errNoCommand    = errors.New("missing command: run, elect, observe, holders, members or shards (see 'lockctl --help')")
	errEmptyName    = errors.New("the lock name is empty")
	errNameNUL      = errors.New("the lock name has a NUL byte")
	errMissingDash  = errors.New("missing -- before the command")
	errNoCmdAfter   = errors.New("no command after --")
	errHoldExclude  = errors.New("--read, --write and --sem exclude each other")
	errSeveralNames = errors.New("several names take a lock on each (a MultiLock): --read, --write and --sem take one name")
	errTryTimeout   = errors.New("--try and --timeout exclude each other")
	errPermitsNoSem = errors.New("--permits needs --sem")
	errUserPassword = errors.New("--user needs a password: --user NAME:PASSWORD, --password or ETCDCTL_PASSWORD")
	errCertKey      = errors.New("--cert and --key go together")
	errHeld         = errors.New("held by another holder (--try)")
)

// exitError ends lockctl with code; a nil err prints nothing (the
// command's own status, passed through).
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("exit status %d", e.code)
	}
	return e.err.Error()
}

func (e *exitError) Unwrap() error { return e.err }

// fail returns err as an error that ends lockctl with code.
func fail(code int, err error) error { return &exitError{code: code, err: err} }

// usage returns err as a usage error (exit 2).
func usage(err error) error { return fail(exitUsage, err) }

// exitStatus ends lockctl with code and no message.
func exitStatus(code int) error { return &exitError{code: code} }

// main runs lockctl and exits with its code.
func main() {
	if len(os.Args) > 1 && os.Args[1] == guardArg {
		os.Exit(guardMain(os.Args[2:]))
	}
	os.Exit(lockctl(os.Args[1:], os.Stdout, os.Stderr))
}

// lockctl runs the command line args and returns the exit code. Errors go
// to stderr as one line prefixed "lockctl: ". It blocks for as long as the
// subcommand does.
func lockctl(args []string, stdout, stderr io.Writer) int {
	// gRPC's own logger writes connection errors to stderr; lockctl
	// reports them itself, once.
	grpclog.SetLoggerV2(grpclog.NewLoggerV2(io.Discard, io.Discard, io.Discard))
	root := newRoot(stdout, stderr)
	root.SetArgs(args)
	err := root.Execute()
	if err == nil {
		return 0
	}
	code := exitUsage // cobra's own errors: unknown commands, flags and arguments
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
		if ee.err == nil {
			return code
		}
	}
	report(stderr, err)
	return code
}

// report writes err to w as one line.
func report(w io.Writer, err error) {
	msg := strings.Join(strings.Fields(err.Error()), " ")
	fmt.Fprintf(w, "lockctl: %s\n", msg)
}

// withCode makes every error of a subcommand an exitError (exit 1 unless
// it says otherwise), so that lockctl tells them from cobra's usage errors.
func withCode(run func(cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		err := run(cmd, args)
		var ee *exitError
		if err == nil || errors.As(err, &ee) {
			return err
		}
		return fail(exitFailure, err)
	}
}

// newRoot builds the command tree.
func newRoot(stdout, stderr io.Writer) *cobra.Command {
	conn := &connFlags{}
	root := &cobra.Command{
		Use:   "lockctl",
		Short: "Run commands under distributed locks on etcd (etcdsync)",
		Long: `lockctl runs commands under etcdsync locks on etcd, so that jobs on many
hosts never overlap, and shows who holds a lock and who waits, and who is
in a group.

Connection flags and their environment variables are etcdctl's:
ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY,
ETCDCTL_INSECURE_SKIP_TLS_VERIFY, ETCDCTL_USER, ETCDCTL_PASSWORD,
ETCDCTL_DIAL_TIMEOUT. A flag overrides its variable. Without
ETCDCTL_ENDPOINTS, ETCD_ENDPOINTS (the examples' variable) names the
endpoints.

--endpoints may name etcd's gRPC proxy (etcd grpc-proxy start). --namespace
puts every key under a prefix, as services whose clients are wrapped by
clientv3/namespace see them: lockctl --namespace tenant/ run jobs/x and a
plain client's lock on tenant/jobs/x exclude each other.`,
		SilenceErrors:     true,
		SilenceUsage:      true,
		CompletionOptions: cobra.CompletionOptions{DisableDefaultCmd: true},
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usage(fmt.Errorf("unknown command %q (commands: run, elect, observe, holders, members, shards)", args[0]))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error { return usage(errNoCommand) },
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			return conn.fromEnv(cmd.Flags())
		},
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return usage(fmt.Errorf("%w (see '%s --help')", err, cmd.CommandPath()))
	})
	conn.register(root.PersistentFlags())
	root.AddCommand(newRunCmd(conn), newElectCmd(conn), newObserveCmd(conn), newHoldersCmd(conn), newMembersCmd(conn), newShardsCmd(conn))
	return root
}

// checkName returns a usage error for a name etcdsync would refuse, and
// warns on cmd's stderr of a trailing slash: "job/" and "job" are two locks.
func checkName(cmd *cobra.Command, name string) error {
	switch {
	case name == "":
		return usage(errEmptyName)
	case strings.IndexByte(name, 0) >= 0:
		return usage(errNameNUL)
	case strings.HasSuffix(name, "/"):
		fmt.Fprintf(cmd.ErrOrStderr(), "lockctl: warning: %q ends in \"/\": it is a lock apart from %q (its keys are %s/<id>, as etcd's clients write them)\n", name, strings.TrimRight(name, "/"), name)
	}
	return nil
}
