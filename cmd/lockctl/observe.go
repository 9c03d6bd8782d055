//go:build unix

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/etcdsync/etcdsync"
	"github.com/spf13/cobra"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
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

// emptied says that the election had no leader at revision rev, after the
// leader with key went.
type emptied struct {
	key string
	rev int64
}

// observe prints the election's leaders to out until a signal arrives. It
// follows the leader with an etcdsync Observer and watches the current
// leader's key to tell when the election empties. Lines come in revision
// order: an event older than the last line printed is dropped. It joins
// every goroutine it starts before returning.
func observe(cf *connFlags, name string, out io.Writer) error {
	sigs, stopSignals := notifySignals()
	defer stopSignals()
	prefix := name + "/"
	cli, err := cf.dial(context.Background(), prefix)
	if err != nil {
		return err
	}
	defer cli.Close()

	rctx, rcancel := context.WithTimeout(context.Background(), cf.dialTimeout)
	first, err := readLeader(rctx, cli, prefix, 0)
	rcancel()
	if err != nil {
		return fmt.Errorf("read the leader of %s: %w", name, err)
	}
	var last int64 // revision of the last line printed
	var cur string // key of the leader printed last; "" after "no leader"
	if leaderOf(prefix, first.Kvs) == nil {
		fmt.Fprintln(out, "no leader")
		last = first.Header.Revision
	}

	ctx, cancel := context.WithCancel(context.Background())
	obs := etcdsync.NewObserver(cli, name)
	updates := obs.Observe(ctx)
	empties := make(chan emptied)
	var w *leaderWatch
	defer func() {
		cancel()
		w.stop()
		for range updates { // the Observer's goroutine ends with ctx
		}
	}()
	for {
		select {
		case <-sigs:
			return nil
		case resp, ok := <-updates:
			if !ok {
				return fmt.Errorf("observe %s: %w", name, obs.Err())
			}
			kv, rev := resp.Kvs[0], resp.Header.Revision
			if rev <= last {
				continue
			}
			fmt.Fprintf(out, "%d %s %s\n", kv.CreateRevision, kv.Key, strconv.Quote(string(kv.Value)))
			last, cur = rev, string(kv.Key)
			w.stop()
			w = watchLeader(ctx, cli, prefix, cur, rev, empties)
		case e := <-empties:
			if e.key != cur || e.rev <= last {
				continue
			}
			fmt.Fprintln(out, "no leader")
			last, cur = e.rev, ""
		}
	}
}

// readLeader lists the election's keys, oldest first, at revision rev (0:
// the current one; a compacted one reads the current one), in one or two
// reads bounded by ctx.
func readLeader(ctx context.Context, cli *clientv3.Client, prefix string, rev int64) (*clientv3.GetResponse, error) {
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithKeysOnly(),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	resp, err := cli.Get(ctx, prefix, append(opts, clientv3.WithRev(rev))...)
	if rev != 0 && errors.Is(err, rpctypes.ErrCompacted) {
		return cli.Get(ctx, prefix, opts...)
	}
	return resp, err
}

// leaderOf returns the oldest direct child NAME/<id> in kvs (sorted by
// create revision), the leader by etcdsync's rule, or nil.
func leaderOf(prefix string, kvs []*mvccpb.KeyValue) *mvccpb.KeyValue {
	for _, kv := range kvs {
		if rest, ok := strings.CutPrefix(string(kv.Key), prefix); ok && isID(rest) {
			return kv
		}
	}
	return nil
}

// leaderWatch is a goroutine watching one leader's key.
type leaderWatch struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// watchLeader starts a goroutine that waits for key to be deleted after
// revision from, then reads the election as the delete left it: with no
// leader, it sends the delete's revision on out. It does not block; ctx and
// stop end the goroutine.
func watchLeader(ctx context.Context, cli *clientv3.Client, prefix, key string, from int64, out chan<- emptied) *leaderWatch {
	ctx, cancel := context.WithCancel(ctx)
	w := &leaderWatch{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		rev, ok := waitDeleted(ctx, cli, key, from)
		if !ok {
			return
		}
		resp, err := readLeader(ctx, cli, prefix, rev)
		if rev == 0 && err == nil {
			rev = resp.Header.Revision
		}
		if err != nil || leaderOf(prefix, resp.Kvs) != nil {
			return // ctx ended, or the Observer reports the next leader
		}
		select {
		case out <- emptied{key: key, rev: rev}:
		case <-ctx.Done():
		}
	}()
	return w
}

// stop ends the goroutine and waits for it. It is a no-op on nil.
func (w *leaderWatch) stop() {
	if w != nil {
		w.cancel()
		<-w.done
	}
}

// waitDeleted blocks until key is deleted after revision from, and returns
// the delete's revision, or until ctx ends (ok false). A watch the server
// cancels (the history it needs compacted) returns revision 0: the caller
// reads the current state instead.
func waitDeleted(ctx context.Context, cli *clientv3.Client, key string, from int64) (rev int64, ok bool) {
	for wr := range cli.Watch(ctx, key, clientv3.WithRev(from+1), clientv3.WithFilterPut()) {
		if wr.Canceled {
			return 0, ctx.Err() == nil
		}
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.DELETE {
				return ev.Kv.ModRevision, true
			}
		}
	}
	return 0, false
}

// isID reports whether s is a key's last part as etcdsync and etcd write
// it: a lease ID in hex (or a number), nothing else.
func isID(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
