//go:build unix

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/etcdsync/etcdsync"
	"github.com/spf13/cobra"
)

// newObserveCmd is "lockctl observe".
func newObserveCmd(conn *connFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "observe [flags] NAME",
		Short: "Print one line per change of leader of the election NAME",
		Long: `Print the leader of the election NAME, then one line per change: a new
leader, or a new value proclaimed by the leader. Each line is
  <create-revision> <key> <quoted value>
or "no leader" when the election has none (at start, or when the leader
goes with no candidate behind it). It needs no lease: it holds nothing in
etcd. It runs until SIGINT or SIGTERM (exit 0); etcd unreachable at start
is exit 1, and later outages are waited out.`,
		Example: `  lockctl observe billing-leader`,
		Args:    cobra.ArbitraryArgs,
		RunE: withCode(func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usage(fmt.Errorf("want NAME, got %d argument(s) (see '%s --help')", len(args), cmd.CommandPath()))
			}
			if err := checkName(cmd, args[0]); err != nil {
				return err
			}
			return observe(conn, args[0], cmd.OutOrStdout())
		}),
	}
}

// observe prints the election's terms to out until a signal arrives: the
// state when it starts, then each new leader, proclaimed value and "no
// leader", as the library's Observer reports them. The first read is bounded
// by the dial timeout (etcd unreachable at start is an error); later outages
// are waited out. It joins the Observer's goroutine before returning.
func observe(cf *connFlags, name string, out io.Writer) error {
	sigs, stopSignals := notifySignals()
	defer stopSignals()
	cli, err := cf.dial(context.Background(), name+"/")
	if err != nil {
		return err
	}
	defer cli.Close()

	obs := etcdsync.NewObserver(cli, name)
	rctx, rcancel := context.WithTimeout(context.Background(), cf.dialTimeout)
	_, err = obs.Leader(rctx)
	rcancel()
	if err != nil && !errors.Is(err, etcdsync.ErrElectionNoLeader) {
		return fmt.Errorf("read the leader of %s: %w", name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	terms := obs.Terms(ctx)
	defer func() {
		cancel()
		for range terms { // the Observer's goroutine ends with ctx
		}
	}()
	for {
		select {
		case <-sigs:
			return nil
		case t, ok := <-terms:
			if !ok {
				return fmt.Errorf("observe %s: %w", name, obs.Err())
			}
			if t.Leader == nil {
				fmt.Fprintln(out, "no leader")
				continue
			}
			fmt.Fprintf(out, "%d %s %s\n", t.Leader.CreateRevision, t.Leader.Key, strconv.Quote(string(t.Leader.Value)))
		}
	}
}
